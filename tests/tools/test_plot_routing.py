#!/usr/bin/env python3
"""Tests of tools/plot_routing.py on the tiny CSVs in tests/tools/fixtures.

Runs the tool as a program (with this interpreter, which must be able to import matplotlib) into
temporary directories and checks the PNGs it writes, the repeated-label (seeds) path, and exit
status 2 with a message (never a traceback) for each kind of bad input. Plain unittest:

    /usr/bin/python3 tests/tools/test_plot_routing.py
"""
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "tools", "plot_routing.py")
FIXTURES = os.path.join(HERE, "fixtures")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_OUTPUTS = ["curves.png", "fluctuation.png", "entropy_ratio.png", "graph_entropy.png",
               "tokens_per_expert.png", "vision_curves.png"]


def fixture(name):
    return os.path.join(FIXTURES, name)


def arg(label, name):
    """The tool's LABEL=PATH argument for a fixture."""
    return f"{label}={fixture(name)}"


def details(result):
    return f"exit status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def load_tool():
    """tools/plot_routing.py as a module, for the checks of its averaging."""
    spec = importlib.util.spec_from_file_location("plot_routing", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(*args):
    env = dict(os.environ, MPLBACKEND="Agg")
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env,
                          timeout=300)


class PlotRoutingTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="plot_routing_")
        self.out = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def plot(self, *inputs, title=None):
        args = ["--out", self.out] + (["--title", title] if title else []) + list(inputs)
        result = run_tool(*args)
        self.assertEqual(result.returncode, 0, details(result))
        self.assertNotIn("Traceback", result.stderr)
        return result

    def written(self):
        return sorted(f for f in os.listdir(self.out) if f.endswith(".png"))

    def assert_png(self, name):
        import matplotlib.image

        path = os.path.join(self.out, name)
        self.assertTrue(os.path.isfile(path), f"{name} was not written")
        with open(path, "rb") as f:
            self.assertEqual(f.read(len(PNG_SIGNATURE)), PNG_SIGNATURE, f"{name} is not a PNG")
        image = matplotlib.image.imread(path)
        self.assertEqual(image.ndim, 3, f"{name}: shape {image.shape}")
        self.assertGreater(image.shape[0], 100, f"{name}: height {image.shape[0]}")
        self.assertGreater(image.shape[1], 100, f"{name}: width {image.shape[1]}")
        self.assertGreater(float(image.std()), 0.0, f"{name} is blank")

    def assert_bad_input(self, expected, *inputs):
        """Exit status 2, a message containing `expected` on stderr, no traceback, no figure."""
        result = run_tool("--out", self.out, *inputs)
        self.assertEqual(result.returncode, 2, details(result))
        self.assertNotIn("Traceback", result.stderr)
        self.assertIn("error", result.stderr)
        self.assertIn(expected, result.stderr)
        self.assertEqual(self.written(), [], "a figure was written despite bad input")
        return result

    # ---- figures ----

    def test_all_figures_from_two_labels(self):
        result = self.plot(
            arg("softmax", "metrics_softmax.csv"), arg("similarity", "metrics_similarity.csv"),
            arg("softmax", "report_softmax.csv"), arg("similarity", "report_similarity.csv"),
            arg("softmax", "load_softmax.csv"), arg("similarity", "load_similarity.csv"),
            arg("softmax", "vision_metrics.csv"),
            title="fixtures")
        self.assertEqual(self.written(), sorted(ALL_OUTPUTS))
        printed = result.stdout.splitlines()
        for name in ALL_OUTPUTS:
            self.assert_png(name)
            self.assertIn(os.path.join(self.out, name), printed)

    def test_repeated_labels_are_averaged(self):
        result = self.plot(
            arg("softmax", "metrics_softmax.csv"), arg("softmax", "metrics_softmax_seed2.csv"),
            arg("similarity", "metrics_similarity.csv"),
            arg("softmax", "report_softmax.csv"), arg("softmax", "report_softmax_seed2.csv"),
            arg("similarity", "report_similarity.csv"),
            arg("softmax", "load_softmax.csv"), arg("softmax", "load_softmax_seed2.csv"),
            arg("similarity", "load_similarity.csv"),
            arg("softmax", "vision_metrics.csv"), arg("softmax", "vision_metrics_seed2.csv"))
        self.assertEqual(self.written(), sorted(ALL_OUTPUTS))
        self.assertEqual(len(result.stdout.splitlines()), len(ALL_OUTPUTS))
        for name in ALL_OUTPUTS:
            self.assert_png(name)

    def test_only_the_figures_of_the_given_kinds(self):
        self.plot(arg("softmax", "load_softmax.csv"))
        self.assertEqual(self.written(), ["tokens_per_expert.png"])
        self.assert_png("tokens_per_expert.png")

    def test_all_nan_report_columns_skip_their_figures(self):
        # no baseline / compare model: the ratio and fluct columns are all nan, and so is the graph
        result = self.plot(arg("similarity", "report_nobaseline.csv"))
        self.assertEqual(self.written(), [])
        for name in ("fluctuation.png", "entropy_ratio.png", "graph_entropy.png"):
            self.assertIn(f"{name} not written", result.stderr)
        # with a report that has values, the same input only leaves gaps
        self.plot(arg("similarity", "report_nobaseline.csv"),
                  arg("softmax", "report_similarity.csv"))
        self.assertEqual(self.written(),
                         ["entropy_ratio.png", "fluctuation.png", "graph_entropy.png"])

    def test_empty_fields_are_missing_values(self):
        # what train_lm and routing_report write for a metric that cannot be computed: the
        # fluctuation at the first evaluation, the ratios and fluctuations without a baseline or
        # compare model (an empty field, read like nan)
        tool = load_tool()
        metrics = tool.read_table("softmax", fixture("metrics_missing.csv"))
        fluct = metrics.array("layer0_fluctuation")
        self.assertTrue(math.isnan(fluct[0]))
        self.assertEqual(fluct[1], 0.12)
        report = tool.read_table("softmax", fixture("report_missing.csv"))
        for column in ("entropy_r_ratio", "entropy_p_ratio", "fluct_top1", "fluct_topk"):
            self.assertTrue(math.isnan(report.array(column)[0]), column)
        result = self.plot(arg("softmax", "metrics_missing.csv"),
                           arg("softmax", "report_missing.csv"))
        self.assertEqual(self.written(), ["curves.png", "graph_entropy.png"])
        for name in ("fluctuation.png", "entropy_ratio.png"):
            self.assertIn(f"{name} not written", result.stderr)
        self.assert_png("curves.png")

    def test_output_directory_is_created(self):
        nested = os.path.join(self.out, "a", "b")
        result = run_tool("--out", nested, arg("run", "vision_metrics.csv"))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertTrue(os.path.isfile(os.path.join(nested, "vision_curves.png")))

    # ---- the averaging of repeated labels (in process) ----

    def test_seed_curves_are_aligned_on_steps(self):
        tool = load_tool()
        a = tool.read_table("softmax", fixture("metrics_softmax.csv"))
        b = tool.read_table("softmax", fixture("metrics_softmax_seed2.csv"))
        steps, matrix = tool.align_on([a, b], "step", "train_loss")
        self.assertEqual(steps.tolist(), [50, 100, 150, 200, 250])
        mean, lo, hi = tool.spread(matrix)
        self.assertAlmostEqual(mean[0], (6.1 + 6.16) / 2)
        self.assertEqual((lo[0], hi[0]), (6.1, 6.16))
        # step 250 only in the second seed: its value alone
        self.assertEqual((mean[4], lo[4], hi[4]), (4.8, 4.8, 4.8))

    def test_seed_layer_values_skip_nan(self):
        tool = load_tool()
        tables = [tool.read_table("softmax", fixture(f))
                  for f in ("report_softmax.csv", "report_softmax_seed2.csv")]
        layers, series = tool.layer_values({"softmax": tables}, "fluct_topk")
        self.assertEqual(layers, [1, 3])
        mean, lo, hi, repeats = series["softmax"]
        self.assertEqual(repeats, 2)
        self.assertAlmostEqual(mean[0], (0.231 + 0.243) / 2)
        self.assertEqual((lo[1], hi[1]), (0.249, 0.254))
        _, series = tool.layer_values({"softmax": tables}, "entropy_p_ratio")
        self.assertTrue(all(math.isnan(v) for v in series["softmax"][0]))

    def test_seed_load_shares_are_averaged_by_rank(self):
        tool = load_tool()
        tables = [tool.read_table("softmax", fixture(f))
                  for f in ("load_softmax.csv", "load_softmax_seed2.csv")]
        shares = tool.load_shares({"softmax": tables})
        mean, lo, hi, ids, repeats = shares[1]["softmax"]
        self.assertIsNone(ids)  # expert ids differ between seeds: not shown
        self.assertEqual(repeats, 2)
        self.assertEqual(list(mean), sorted(mean, reverse=True))
        self.assertAlmostEqual(mean[0], (0.41626 + 0.366699) / 2)
        single = tool.load_shares({"softmax": tables[:1]})[1]["softmax"]
        self.assertEqual(single[3], [2, 0, 3, 1])  # expert ids by share, descending

    # ---- bad input: exit status 2 with a message ----

    def test_unknown_kind_shows_the_header(self):
        self.assert_bad_input("step,loss,accuracy", arg("x", "bad_unknown_kind.csv"))

    def test_missing_file(self):
        missing = fixture("no_such_file.csv")
        result = self.assert_bad_input("no such file", f"x={missing}")
        self.assertIn(missing, result.stderr)

    def test_directory_instead_of_file(self):
        self.assert_bad_input("is a directory", f"x={FIXTURES}")

    def test_header_only(self):
        self.assert_bad_input("no data rows", arg("x", "bad_header_only.csv"))

    def test_empty_file(self):
        self.assert_bad_input("empty file", arg("x", "bad_empty.csv"))

    def test_malformed_label_path(self):
        for spec in (fixture("load_softmax.csv"), f"={fixture('load_softmax.csv')}", "softmax="):
            with self.subTest(spec=spec):
                self.assert_bad_input("expected LABEL=PATH", spec)

    def test_non_numeric_value_names_file_line_and_column(self):
        result = self.assert_bad_input("expected a number, got 'zero'",
                                       arg("x", "bad_non_numeric.csv"))
        self.assertIn(f"{fixture('bad_non_numeric.csv')}:3: column 7 ('graph_entropy')",
                      result.stderr)

    def test_row_of_the_wrong_width(self):
        self.assert_bad_input(f"{fixture('bad_ragged.csv')}:3: 3 fields, but the header has 4",
                              arg("x", "bad_ragged.csv"))

    def test_non_integer_layer(self):
        self.assert_bad_input("column 1 ('layer'): expected a non-negative integer, got '1.5'",
                              arg("x", "bad_layer_id.csv"))

    def test_empty_layer_id(self):
        self.assert_bad_input("column 1 ('layer'): expected a non-negative integer, got ''",
                              arg("x", "bad_empty_layer.csv"))

    def test_repeated_key(self):
        self.assert_bad_input("more than one row for layer 1, expert 0",
                              arg("x", "bad_duplicate_key.csv"))

    def test_one_bad_input_among_good_ones_writes_nothing(self):
        self.assert_bad_input("no data rows", arg("softmax", "load_softmax.csv"),
                              arg("similarity", "bad_header_only.csv"))

    def test_no_inputs_is_a_usage_error(self):
        result = run_tool("--out", self.out)
        self.assertEqual(result.returncode, 2)
        self.assertNotIn("Traceback", result.stderr)
        self.assertIn("usage:", result.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
