#!/usr/bin/env python3
"""Runs every shell command of README.md and docs/tutorials/*.md, on a small setting, so that a
page whose command fails as written is a failing test (ctest: "docs: every shell command ... runs").

  run_commands.py --build BUILD --data DATA --scratch DIR [--without mpi|hf ...] [PAGE ...]
  run_commands.py --list [PAGE ...]

PAGE defaults to README.md and docs/tutorials/*.md in reading order (the train-lm tutorial before
the generate one, which continues its run). The pages' ```sh blocks run in that order, each line
in turn, in one scratch folder laid out as the repository root the pages start from:

  DIR/repo/build            the build tree BUILD (its examples/ programs)
  DIR/repo/scripts          the repository's scripts/
  DIR/shared/data           DATA (the pages' ../shared/data), with wikitext-2/'s files cut to their
                            first 300 lines
  DIR/repo/prompt.txt       a prompt, which the pages ask the reader to write
  DIR/repo/runs/data/kjv.tokens
                            the main job's corpus (scripts/prepare-kjv.sh; Debian's bible-kjv),
                            its first 1,000 verses
  DIR/repo/path/to/olmoe    the pages' Hugging Face model directory (also path/to/model): the
                            tests' tiny OLMoE (tests/hf/fixtures/olmoe) with a vocabulary of 300
                            and a byte-level BPE tokenizer.json
  DIR/repo/corpus.txt, train.txt, valid.txt
                            the pages' text files for --hf: lines of WikiText-2

A block that cannot run in a test says why on the line above its fence, and is listed, not run:

  <!-- docs-check: not run: configures and installs a tree of its own -->

--without mpi (a build without graphmoe::mpi) lists the mpirun commands instead of running them,
--without hf (without graphmoe::hf_tokenizer) those with --hf.

The small setting rewrites the example programs' flags (also under mpirun): train_lm runs 2
steps (--steps), 1 block where the page sets --layers, --d-model 32 where it sets one, --batch 2
(or --dp N's smallest multiple), --seq 16, 4 sampled tokens; generate and routing_report keep their
flags, generate writes 4 tokens. A router the build leaves out (cmake/ci.cmake builds a subset) runs
as one it has, of the same kind where there is one (said in the output); a full build runs each
router as written. Every line must exit 0; the first failure ends its page, and the script exits 1
after the last page, printing each failure's command, exit status and output. --root ROOT (default:
this file's repository) is the tree whose pages run; test_run_commands.py points it at small
trees. Python 3 standard library only.
"""
import argparse
import json
import os
import random
import re
import shlex
import shutil
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PAGES = ["README.md", "docs/tutorials/train-lm.md", "docs/tutorials/generate.md",
                 "docs/tutorials/upcycle.md", "docs/tutorials/mpirun.md",
                 "docs/tutorials/custom-policy.md", "docs/tutorials/gpu.md"]
SHELL_LANGS = {"sh", "bash", "shell", "console"}
NOT_RUN = re.compile(r"^\s*<!--\s*docs-check:\s*not run:\s*(\S.*?)\s*-->\s*$")
PROGRAMS = {"train_lm", "generate", "routing_report"}
WIKITEXT_LINES = 300
TIMEOUT_S = 600
# A router the build does not have runs as the first of these that it has.
ROUTER_STAND_INS = {
    "similarity": ["xmoe-similarity", "smoe-dropout-similarity", "sigmoid-bias-similarity"],
    "attention": ["xmoe-attention", "smoe-dropout-attention", "sigmoid-bias-attention",
                  "xmoe-similarity"],
    "blended-similarity": ["blended-attention"],
    "blended-attention": ["blended-similarity"],
}


class Block:
    def __init__(self, page, line, text, not_run):
        self.page, self.line, self.text, self.not_run = page, line, text, not_run

    def where(self):
        return f"{self.page}:{self.line}"


def blocks_of(page):
    """The ```sh blocks of a page, with the reason of a <!-- docs-check: not run: ... --> above."""
    out, fence, start, body, last = [], None, 0, [], ""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            m = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
            if m and fence is None:
                fence, lang, start, body = m.group(1), m.group(2), n, []
                m_not = NOT_RUN.match(last)
                reason = m_not.group(1) if m_not else None
                continue
            if m and line.strip().startswith(fence) and fence is not None:
                if lang in SHELL_LANGS:
                    out.append(Block(page, start, "".join(body), reason))
                fence, last = None, line
                continue
            if fence is not None:
                body.append(line)
            elif line.strip():
                last = line
    return out


def commands_of(block):
    """The block's commands: continuation lines joined, comments dropped, `a && b` split."""
    joined = re.sub(r"\\\n", " ", block.text)
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if any(w in ("|", ";", "||", ">", "<", "&") for w in words):
            raise ValueError(f"{block.where()}: '{line.strip()}' uses shell syntax the test does "
                             "not run: one command per line (&& allowed), or mark the block "
                             "<!-- docs-check: not run: REASON -->")
        current = []
        for w in words:
            if w == "&&":
                commands.append(current)
                current = []
            else:
                current.append(w)
        commands.append(current)
    return [c for c in commands if c]


def help_routers(program):
    """The --router choices of a built program (`--router TEXT:{a,b,c}=...` in its --help)."""
    try:
        text = subprocess.run([program, "--help"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"--router TEXT:\{([^}]*)\}", text)
    return m.group(1).split(",") if m else None


def set_flag(argv, flag, value, only_if_present=False):
    """argv with FLAG's value replaced (every occurrence), or appended when absent."""
    out, found, i = [], False, 0
    while i < len(argv):
        if argv[i] == flag and i + 1 < len(argv):
            out += [flag, value]
            found = True
            i += 2
            continue
        out.append(argv[i])
        i += 1
    if not found and not only_if_present:
        out += [flag, value]
    return out


def flag_value(argv, flag):
    for i, w in enumerate(argv[:-1]):
        if w == flag:
            return argv[i + 1]
    return None


def small(argv, routers, notes):
    """The example program's argv on the small setting (module docstring)."""
    name = os.path.basename(argv[0])
    if name == "train_lm":
        argv = set_flag(argv, "--steps", "2")
        argv = set_flag(argv, "--layers", "1", only_if_present=True)
        argv = set_flag(argv, "--d-model", "32", only_if_present=True)
        dp = flag_value(argv, "--dp")
        argv = set_flag(argv, "--batch", dp if dp and dp.isdigit() and int(dp) > 1 else "2")
        argv = set_flag(argv, "--seq", "16")
        argv = set_flag(argv, "--sample-tokens", "4")
    elif name == "generate":
        argv = set_flag(argv, "--max-new-tokens", "4")
    router = flag_value(argv, "--router")
    if router and routers is not None and router not in routers.get(name, [router]):
        have = routers[name]
        stand_in = next((r for r in ROUTER_STAND_INS.get(router, []) if r in have), have[0])
        notes.append(f"--router {router} runs as {stand_in}: this build's {name} has "
                     f"{', '.join(have)}")
        argv = set_flag(argv, "--router", stand_in)
    return argv


def example_argv(argv):
    """Where the example program's own argv starts in a command (0, or after mpirun's flags)."""
    for i, w in enumerate(argv):
        if os.path.basename(w) in PROGRAMS and (i == 0 or argv[0] in ("mpirun", "mpiexec")):
            return i
    return None


def byte_chars():
    """GPT-2's bytes_to_unicode: the character that stands for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    out = [""] * 256
    for b, c in zip(bs, cs):
        out[b] = chr(c)
    return out


HF_VOCAB = 300


def tokenizer_json(words):
    """A byte-level BPE tokenizer.json: <s> 0, </s> 1, the 256 bytes, merges making each word one
    token (tests/support/byte_level_tokenizer.hpp's layout)."""
    chars = byte_chars()
    vocab = {"<s>": 0, "</s>": 1}
    for b in range(256):
        vocab[chars[b]] = 2 + b
    merges = []
    for word in words:
        token = ""
        for byte in word.encode("utf-8"):
            ch = chars[byte]
            if token and token + ch not in vocab and len(vocab) < HF_VOCAB:
                merges.append(f"{token} {ch}")
                vocab[token + ch] = len(vocab)
            token += ch

    def special(i, content):
        return {"id": i, "content": content, "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": True}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [special(0, "<s>"), special(1, "</s>")], "normalizer": None,
            "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


def write_hf_model(out):
    """tests/hf/fixtures/olmoe with a vocabulary of HF_VOCAB (the embedding and the output layer
    grown with small random bf16 values), <s> / </s> as bos / eos, and a tokenizer.json."""
    src = os.path.join(ROOT, "tests", "hf", "fixtures", "olmoe")
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    old_vocab = config["vocab_size"]
    config.update(vocab_size=HF_VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    rng = random.Random(1)
    new_header, blobs, offset = {}, [], 0
    for name, t in header.items():
        if name == "__metadata__":
            new_header[name] = t
            continue
        begin, end = t["data_offsets"]
        blob, shape = data[begin:end], list(t["shape"])
        if shape and shape[0] == old_vocab and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            if t["dtype"] != "BF16":
                raise RuntimeError(f"{src}: {name} is {t['dtype']}, expected BF16")
            extra = (HF_VOCAB - old_vocab) * shape[1]
            grown = bytearray(blob)
            for _ in range(extra):  # bf16: the high half of a float32
                grown += struct.pack("<f", rng.gauss(0.0, 0.02))[2:]
            blob, shape = bytes(grown), [HF_VOCAB] + shape[1:]
        new_header[name] = {"dtype": t["dtype"], "shape": shape,
                            "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(new_header).encode("utf-8")
    head += b" " * (-len(head) % 8)
    os.makedirs(out)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    words = [" the", " king", " said", " In", " beginning", " and", " of", "the"]
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(words), f)


def first_lines(src, dst, count):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(src, encoding="utf-8") as fin, open(dst, "w", encoding="utf-8") as fout:
        for n, line in enumerate(fin):
            if n >= count:
                break
            fout.write(line)


def prepare(scratch, build, data, wanted):
    """The scratch repository; the fixtures the pages' commands (their text: wanted) name."""
    if os.path.exists(scratch):
        shutil.rmtree(scratch)
    repo = os.path.join(scratch, "repo")
    shared = os.path.join(scratch, "shared", "data")
    os.makedirs(repo)
    os.makedirs(shared)
    os.symlink(os.path.abspath(build), os.path.join(repo, "build"))
    os.symlink(os.path.join(ROOT, "scripts"), os.path.join(repo, "scripts"))  # the real ones
    for entry in sorted(os.listdir(data)):
        src = os.path.join(data, entry)
        if entry == "wikitext-2" and os.path.isdir(src):
            for f in sorted(os.listdir(src)):
                first_lines(os.path.join(src, f), os.path.join(shared, entry, f), WIKITEXT_LINES)
        else:
            os.symlink(os.path.abspath(src), os.path.join(shared, entry))
    with open(os.path.join(repo, "prompt.txt"), "w", encoding="utf-8") as f:
        f.write("the king said\n")
    kjv = os.path.join(repo, "runs", "data", "kjv.tokens")
    if "runs/data/kjv.tokens" in wanted:
        make_kjv(kjv)
    if "path/to/" in wanted:
        write_hf_model(os.path.join(repo, "path", "to", "olmoe"))
        os.symlink("olmoe", os.path.join(repo, "path", "to", "model"))
    wiki = os.path.join(shared, "wikitext-2")
    for name, src, count in (("corpus.txt", "wiki.valid.tokens", 200),
                             ("train.txt", "wiki.valid.tokens", 200),
                             ("valid.txt", "wiki.test.tokens", 100)):
        if os.path.exists(os.path.join(wiki, src)):
            first_lines(os.path.join(wiki, src), os.path.join(repo, name), count)
    return repo


def make_kjv(kjv):
    os.makedirs(os.path.dirname(kjv))
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "prepare-kjv.sh"), kjv + ".all"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("scripts/prepare-kjv.sh failed (the pages' runs/data/kjv.tokens; "
                           f"bash scripts/install-deps.sh installs bible-kjv):\n{r.stderr}")
    first_lines(kjv + ".all", kjv, 1000)
    os.remove(kjv + ".all")


def missing_feature(argv, without):
    if "mpi" in without and argv and argv[0] in ("mpirun", "mpiexec"):
        return "this build has no MPI (graphmoe::mpi)"
    if "hf" in without and "--hf" in argv:
        return "this build has no Hugging Face tokenizer (graphmoe::hf_tokenizer)"
    return None


def run_command(argv, repo, env):
    """(exit status, output) of one command run in the scratch repository."""
    try:
        r = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        return r.returncode, r.stdout + r.stderr
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return "timeout", f"still running after {TIMEOUT_S} s"


def run_pages(pages, build, data, scratch, without):
    blocks = [b for page in pages for b in blocks_of(page)]
    repo = prepare(scratch, build, data, "".join(b.text for b in blocks if not b.not_run))
    routers = {}
    for p in PROGRAMS:
        exe = os.path.join(build, "examples", p)
        have = help_routers(exe) if os.path.exists(exe) else None
        if have:
            routers[p] = have
    env = dict(os.environ, GRAPHMOE_DATA_DIR=os.path.join(scratch, "shared", "data"), PWD=repo)
    os.environ["PWD"] = repo  # $PWD in a command: the scratch repository
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    failures, ran, skipped, stopped = [], 0, 0, set()
    for block in blocks:
        if block.page in stopped:  # a page's later commands use what its earlier ones wrote
            continue
        if block.not_run:
            print(f"{block.where()}: not run: {block.not_run}")
            skipped += 1
            continue
        try:
            commands = commands_of(block)
        except ValueError as e:
            failures.append(str(e))
            stopped.add(block.page)
            continue
        for argv in commands:
            argv = [os.path.expandvars(w) for w in argv]
            why = missing_feature(argv, without)
            if why:
                print(f"{block.where()}: not run: {shlex.join(argv)}: {why}")
                continue
            notes = []
            start = example_argv(argv)
            if start is not None:
                argv = argv[:start] + small(argv[start:], routers, notes)
            shown = shlex.join(argv)
            print(f"{block.where()}: {shown}", flush=True)
            for note in notes:
                print(f"  ({note})")
            rc, output = run_command(argv, repo, env)
            ran += 1
            if rc != 0:
                tail = "\n".join(output.rstrip().splitlines()[-30:])
                failures.append(f"{block.where()}: `{shown}` exited {rc}:\n{tail}")
                stopped.add(block.page)
                break
    print(f"{ran} commands run, {skipped} blocks not run, {len(failures)} failed")
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", default=DEFAULT_PAGES)
    ap.add_argument("--list", action="store_true", help="print the blocks and their commands")
    ap.add_argument("--root", help="the repository whose pages run (default: this one)")
    ap.add_argument("--build", help="the build tree (its examples/ programs)")
    ap.add_argument("--data", help="the data sets (GRAPHMOE_DATA_DIR)")
    ap.add_argument("--scratch", help="the scratch folder (emptied first)")
    ap.add_argument("--without", action="append", default=[], choices=["mpi", "hf"],
                    help="a feature this build lacks: its commands are listed, not run")
    a = ap.parse_args()
    if a.root:
        global ROOT
        ROOT = os.path.abspath(a.root)
    if a.list:
        for page in a.pages:
            for block in blocks_of(page):
                if block.not_run:
                    print(f"{block.where()}: not run: {block.not_run}")
                else:
                    for argv in commands_of(block):
                        print(f"{block.where()}: {shlex.join(argv)}")
        return 0
    for name in ("build", "data", "scratch"):
        if not getattr(a, name):
            ap.error(f"--{name} is required (or --list)")
    for name in ("build", "data"):
        if not os.path.isdir(getattr(a, name)):
            ap.error(f"--{name} '{getattr(a, name)}' is not a directory")
    return run_pages(a.pages, a.build, a.data, a.scratch, set(a.without))


if __name__ == "__main__":
    sys.exit(main())
