// train_lm: the reference training loop (one function template, instantiated per router).
//
// forward -> zero_grad -> backward -> clip -> AdamW step, with a warmup + cosine learning rate,
// on the CPU or (B = graphmoe::cuda, --device cuda) the GPU,
// periodic evaluation (perplexity and routing metrics to metrics.csv), atomic checkpoints with the
// optimizer state, and --resume that continues bit for bit.
//
// --dp N (common/data_parallel.hpp, docs/distributed.md): every rank runs this loop on the same
// global batches and trains on its shard of each; the gradients are averaged before clipping,
// the training loss the guard sees is the mean over the ranks, evaluation batches are sharded
// too (the same mean), and only rank 0 prints and writes files. With one process every one of
// these steps is the identity, and the loop is the one it always was.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/hf/reader.hpp"
#include "graphmoe/hf/writer.hpp"
#include "graphmoe/inference/generate.hpp"
#include "graphmoe/models/upcycling.hpp"
#include "graphmoe/train/training_state.hpp"
#include "graphmoe/train/lm_batcher.hpp"
#include "graphmoe/train/metrics.hpp"
#include "graphmoe/train/optim.hpp"
#include "graphmoe/train/progress.hpp"
#include "graphmoe/train/schedule.hpp"
#include "graphmoe/train/text_attack.hpp"
#include "common/data_parallel.hpp"
#include "common/device.hpp"
#include "common/divergence.hpp"
#include "common/lm_config.hpp"
#include "common/resume.hpp"
#include "train_lm/options.hpp"

namespace train_lm {

using namespace graphmoe;
using Scalar = float;

// The checkpoint's configuration: the model (as finetune_classifier reads it) and the run.
inline nlohmann::json config_json(const Options& opt, const TransformerLMConfig& model) {
  nlohmann::json j = examples::lm_config_json(model, opt.router, opt.char_level);
  j["batch"] = opt.batch;
  j["seed"] = opt.seed;
  return j;
}

// Mean cross-entropy over the first `max_batches` (0 = all) batches of a stream; with `attacked`,
// the inputs come from the attacked stream and the targets from the clean one. With --dp, each
// rank evaluates its shard of every batch and the sum is averaged over the ranks (collective).
template <class B, class Model>
double evaluate(Model& lm, const LMBatcher& batches, index_t max_batches,
                const examples::DataParallel& dp, const LMBatcher* attacked = nullptr) {
  const index_t nb = max_batches > 0 ? std::min(max_batches, batches.num_batches()) : batches.num_batches();
  ModeScope<Model> eval(lm, Mode::Eval);  // a bias-balancing router counts no loads here
  double sum = 0;
  for (index_t i = 0; i < nb; ++i) {
    const LMBatch b = examples::shard(dp, attacked ? attacked_batch(batches, *attacked, i) : batches.batch(i));
    // perplexity is of the task loss (the cross-entropy), not of the auxiliary terms
    sum += lm.forward(examples::on_backend<B>(b.inputs), examples::on_backend<B>(b.targets)).task;
  }
  return nb > 0 ? examples::mean_over_ranks(dp, sum) / static_cast<double>(nb) : std::nan("");
}

// The sample printed at the end of training (stdout, one line): the first opt.sample_prompt
// tokens of the validation text (of the training text without one), then opt.sample_tokens drawn
// by the incremental decoder (graphmoe/inference/generate.hpp) at temperature 0.8 among the 40
// most probable, seeded with the run's seed. Line breaks are shown as " / ". An expert-parallel
// model (--ep) has no incremental decoder: it prints why instead.
template <class Model>
void print_sample(Model& lm, const Options& opt, const Data& data) {
  if (opt.dp.expert_parallel()) {
    std::printf("sample: none (an expert-parallel model, --ep, is not decoded here; load its "
                "checkpoint with examples/generate)\n");
    return;
  }
  const std::vector<std::int32_t>& src = data.valid.empty() ? data.train : data.valid;
  const auto n = static_cast<std::size_t>(
      std::min<index_t>({opt.sample_prompt, lm.config().max_seq_len, static_cast<index_t>(src.size())}));
  if (n == 0) return;
  const std::vector<std::int32_t> prompt(src.begin(), src.begin() + static_cast<std::ptrdiff_t>(n));
  GenerateOptions g;
  g.max_new_tokens = opt.sample_tokens;
  g.sampling.temperature = 0.8;
  g.sampling.top_k = 40;
  g.sampling.seed = opt.seed;
  g.sampling.banned = data.sample_banned;
  const GenerateResult r = generate(lm, prompt, g);
  auto one_line = [](std::string s) {
    std::string out;
    for (char c : s) out += c == '\n' ? std::string(" / ") : std::string(1, c);
    return out;
  };
  std::printf("sample: %s >>> %s\n", one_line(data.detokenize(prompt)).c_str(),
              one_line(data.detokenize(r.tokens)).c_str());
}

// --upcycle-from: lm (initialised) takes the weights of another train_lm checkpoint by
// graphmoe::upcycle's rules (models/upcycling.hpp). The checkpoint's model is rebuilt from its
// stored configuration with its own router type: this run's, or the softmax router (a dense or
// softmax MoE model upcycled into this run's router). Its vocabulary must be this run's.
template <class Policy, class B, class C, class Model>
void upcycle_from_checkpoint(const Options& opt, const TransformerLMConfig& mc, const Data& data,
                             Model& lm) {
  const char* op = "train_lm --upcycle-from";
  const std::string& path = opt.upcycle_from;
  GRAPHMOE_CHECK(!opt.dp.expert_parallel(), op, "upcycle a whole model: not with --ep (upcycle "
                 "once without it, then continue with --resume)");
  const SafetensorsFile f = load_safetensors(path);
  const nlohmann::json saved = metadata_json(f, "config");
  const std::string where = "'" + path + "'";
  GRAPHMOE_CHECK(saved.is_object() && saved.contains("router") && saved["router"].is_string(), op,
                 where, ": the configuration (metadata field 'config') names no router");
  const std::string router = saved["router"].get<std::string>();
  if (const auto rec = examples::vocabulary_record(f, where))
    GRAPHMOE_CHECK(rec->fingerprint == data.vocabulary.fingerprint, op, where,
                   " was trained with the vocabulary ", rec->fingerprint, " (", rec->size,
                   " entries), this run's --train gives ", data.vocabulary.fingerprint, " (",
                   data.vocabulary.size, " entries): the token ids would differ");
  TransformerLMConfig sc = examples::lm_config_from_json(saved, where);
  GRAPHMOE_CHECK(sc.vocab_size == mc.vocab_size, op, where, " has a vocabulary of ", sc.vocab_size,
                 " tokens, this run's has ", mc.vocab_size);
  check_weight_values<Scalar>(f, "model.", op, "the checkpoint's");
  auto from = [&]<class Source>() {
    TransformerLM<Source, Scalar, cpu> src(sc, typename TransformerLM<Source, Scalar, cpu>::NoInit{});
    load_arena(f, src.arena(), "model.");  // strict: every parameter, nothing else of the model
    if constexpr (B::host_memory && std::is_same_v<C, Scalar>) {
      upcycle(src, lm);
    } else {
      // on a device: upcycled on the host into the same layout, then copied (the arenas of one
      // model have the same layout on every backend)
      TransformerLM<Policy, Scalar, cpu> host(mc, opt.seed);
      upcycle(src, host);
      copy_from_host(lm.arena().values(), host.arena().values());
      lm.arena().mark_values_written();
    }
  };
  if (router == opt.router)
    from.template operator()<Policy>();
  else if (router == "softmax")
    from.template operator()<SoftmaxRouter>();
  else
    graphmoe::detail::throw_error(op, where, " was trained with --router ", router,
                                  ": upcycling starts from a softmax model (dense or MoE) or "
                                  "from one of this run's router (", opt.router, ")");
  if (opt.dp.root())
    std::fprintf(stderr, "upcycled from %s (router %s, %s)\n", path.c_str(), router.c_str(),
                 sc.layout == MoELayout::Dense ? "dense" : "MoE");
}

// Whether a Hugging Face model loads into (and saves from) the router Policy: a linear map to
// softmax scores and a top-k choice, or (DeepSeek-V3) to sigmoid scores with a selection bias,
// with any token graph (hf::loadable_router; Checkpoint::load refuses the other kind by name).
template <class Policy>
inline constexpr bool hf_router = hf::loadable_router<Policy>;

// --hf: lm (initialised from the run's seed) takes the directory's weights (hf::Checkpoint::load);
// the token graph's own parameters (Blended's a, a learned temperature) keep their initial values,
// so a blended-* router starts as the model itself (a = 0). On a device the weights are loaded
// into the same model on the host, then copied (the arenas of one model have the same layout).
template <class Policy, class B, class C, class Model>
void load_hf_weights(const Options& opt, const TransformerLMConfig& mc, const Data& data, Model& lm) {
  if constexpr (hf_router<Policy>) {
    if constexpr (B::host_memory && std::is_same_v<C, Scalar>) {
      data.hf->load(lm);
    } else {
      TransformerLM<Policy, Scalar, cpu> host(mc, opt.seed);
      data.hf->load(host);
      copy_from_host(lm.arena().values(), host.arena().values());
      lm.arena().mark_values_written();
    }
    if (opt.dp.root())
      std::fprintf(stderr, "train_lm: loaded %zu tensors (%llu weights) of %s into --router %s\n",
                   data.hf->tensor_count(),
                   static_cast<unsigned long long>(data.hf->element_count()),
                   data.hf->dir().c_str(), opt.router.c_str());
  } else {
    (void)mc, (void)lm;
    graphmoe::detail::throw_error("train_lm --hf", "--router ", opt.router, " cannot load a "
                                  "Hugging Face model (its router is a linear map, softmax and "
                                  "top-k, or DeepSeek-V3's sigmoid scores with a selection bias)");
  }
}

// --save-hf: the trained model saved as a Hugging Face model directory with the input's family,
// keys and token ids (hf::save_lm; config.json's max_position_embeddings as read, not --seq), then
// the input's tokenizer files copied next to it.
template <class Policy, class Model>
void save_hf_model(const Options& opt, const Data& data, const Model& lm) {
  namespace fs = std::filesystem;
  if constexpr (hf_router<Policy>) {
    TransformerLMConfig sc = lm.config();
    sc.max_seq_len = data.hf->config().lm.max_seq_len;
    TransformerLM<Policy, Scalar, cpu> out(sc, typename TransformerLM<Policy, Scalar, cpu>::NoInit{});
    const Tensor<Scalar, cpu> values = examples::host_values(lm.arena().values());
    GRAPHMOE_CHECK(values.numel() == out.arena().values().numel(), "train_lm --save-hf",
                   "the model's parameters (", values.numel(), ") differ from the saved model's (",
                   out.arena().values().numel(), ")");
    std::copy(values.data(), values.data() + values.numel(), out.arena().values().data());
    out.arena().mark_values_written();
    hf::SaveOptions so;
    const std::string& in = data.hf->config().dtype;
    const std::string& d = opt.save_hf_dtype;
    so.dtype = d == "bf16" || (d == "input" && in == "bfloat16")  ? DType::BF16
               : d == "f16" || (d == "input" && in == "float16") ? DType::F16
                                                                 : DType::F32;
    so.drop_graph = opt.save_hf_drop_graph;
    hf::save_lm(out, data.hf->config(), opt.save_hf, so);
    std::vector<std::string> copied;
    for (const std::string& name : hf_tokenizer_files()) {
      const fs::path from = fs::path(data.hf->dir()) / name;
      std::error_code ec;
      if (!fs::is_regular_file(from, ec)) continue;
      fs::copy_file(from, fs::path(opt.save_hf) / name, fs::copy_options::overwrite_existing);
      copied.push_back(name);
    }
    std::string list;
    for (const auto& c : copied) list += (list.empty() ? "" : ", ") + c;
    std::fprintf(stderr, "train_lm: saved the model to %s (%s, %s%s; %s)\n", opt.save_hf.c_str(),
                 data.hf->config().architecture.c_str(), hf::torch_dtype_name(so.dtype),
                 so.drop_graph && opt.router != "softmax" ? ", the token graph dropped" : "",
                 list.empty() ? "no tokenizer files" : list.c_str());
  } else {
    (void)opt, (void)data, (void)lm;
  }
}

// The loop for one model type: C is the GEMM compute type (Scalar, or bf16 with --precision bf16
// on CUDA); parameters, optimizer state and checkpoints are Scalar either way.
template <class Policy, class B, class C>
int run_model(const Options& opt, const Data& data) {
  namespace fs = std::filesystem;
  const auto run_start = std::chrono::steady_clock::now();
  set_num_threads(opt.threads);
  examples::require_device<B>("train_lm");
  TransformerLMConfig mc = opt.model;
  mc.vocab_size = static_cast<index_t>(data.vocab_size);
  // --ep: the experts of every MoE layer split over the ranks (the same seed everywhere gives
  // one process's model); the rest is data parallel as with --dp alone
  using Model = TransformerLM<Policy, Scalar, B, C>;
  Model lm = opt.dp.expert_parallel() ? Model(mc, opt.seed, *opt.dp.comm) : Model(mc, opt.seed);
  const index_t seq = mc.max_seq_len;
  LMBatcher train(data.train, opt.batch, seq);
  LMBatcher valid(data.valid, opt.batch, seq);
  GRAPHMOE_CHECK(train.num_batches() >= 1 && valid.num_batches() >= 1, "train_lm",
                 "the training or validation stream is shorter than one batch of ", opt.batch,
                 " x ", seq + 1, " tokens");

  AdamWConfig acfg;
  acfg.lr = opt.lr;
  acfg.weight_decay = opt.weight_decay;
  AdamW<Scalar, B> adam(lm.arena(), acfg);
  LRSchedule sched{opt.lr, opt.min_lr, std::min(opt.warmup, opt.steps), opt.steps};
  sched.validate();

  const examples::DataParallel& dp = opt.dp;
  const bool root = dp.root();  // prints and writes files; the other ranks write nothing
  if (root) fs::create_directories(opt.out_dir);
  const std::string ckpt = (fs::path(opt.out_dir) / "checkpoint.safetensors").string();
  std::int64_t step = 0;
  if (root) examples::remove_stale_checkpoint_temporaries(ckpt, "train_lm");
  if (opt.resume && examples::checkpoint_to_resume(ckpt, "train_lm")) {
    const SafetensorsFile f = load_safetensors(ckpt);
    const nlohmann::json saved = metadata_json(f, "config");
    GRAPHMOE_CHECK(saved == config_json(opt, mc), "train_lm --resume", "'", ckpt,
                   "': the checkpoint's configuration (metadata field 'config') differs from "
                   "this run's: ", saved.dump(), " vs ", config_json(opt, mc).dump());
    // the vocabulary: a training text changed since the checkpoint gives other ids
    if (const auto rec = examples::vocabulary_record(f, "'" + ckpt + "'"))
      GRAPHMOE_CHECK(rec->fingerprint == data.vocabulary.fingerprint, "train_lm --resume", "'", ckpt,
                     "' was trained with the vocabulary ", rec->fingerprint, " (", rec->size,
                     " entries, normalisation ", rec->normalisation.name(), "), this run's --train "
                     "gives ", data.vocabulary.fingerprint, " (", data.vocabulary.size,
                     " entries, normalisation ", data.vocabulary.normalisation.name(), ")");
    // --hf: the checkpoint must come from --hf with the same tokenizer (the ids), and only then
    const auto rec = f.metadata.find("hf");
    GRAPHMOE_CHECK((rec != f.metadata.end()) == static_cast<bool>(data.hf), "train_lm --resume",
                   "'", ckpt, "' was ", rec != f.metadata.end() ? "" : "not ", "trained with --hf, "
                   "this run is ", data.hf ? "" : "not");
    if (data.hf) {
      nlohmann::json was, now = nlohmann::json::parse(data.hf_record);
      try {
        was = nlohmann::json::parse(rec->second);
      } catch (const nlohmann::json::exception&) {
        graphmoe::detail::throw_error("train_lm --resume", "'", ckpt, "': metadata field 'hf' is not JSON");
      }
      GRAPHMOE_CHECK(was.is_object() && was.value("tokenizer_fingerprint", "") == now["tokenizer_fingerprint"],
                     "train_lm --resume", "'", ckpt, "' was trained with the tokenizer ",
                     was.is_object() ? was.value("tokenizer", "?") : "?", " (",
                     was.is_object() ? was.value("tokenizer_fingerprint", "?") : "?", "), this run's "
                     "--hf gives ", now["tokenizer"].get<std::string>(), " (",
                     now["tokenizer_fingerprint"].get<std::string>(), "): the token ids would differ");
    }
    // the step is checked before load_training_state changes anything
    step = metadata_int(f, "step", 0, std::numeric_limits<std::int64_t>::max());
    load_training_state(f, lm.arena(), adam);
    if (root)
      std::fprintf(stderr, "resumed from %s at step %lld\n", ckpt.c_str(), static_cast<long long>(step));
    // the master weights and the optimizer state are fp32 at either precision, so a checkpoint
    // resumes at either; a change is worth a line (checkpoints before the field: fp32)
    const auto saved_precision = f.metadata.find("precision");
    const std::string was = saved_precision == f.metadata.end() ? "fp32" : saved_precision->second;
    if (root && was != opt.precision)
      std::fprintf(stderr, "train_lm: the checkpoint was trained with --precision %s, this run "
                   "continues with --precision %s\n", was.c_str(), opt.precision.c_str());
  }
  if (!opt.upcycle_from.empty() && step == 0)
    upcycle_from_checkpoint<Policy, B, C>(opt, mc, data, lm);
  if (data.hf && step == 0) load_hf_weights<Policy, B, C>(opt, mc, data, lm);
  if (dp.active()) {
    // every rank read the checkpoint (the output directory must be visible to all of them);
    // they must have found the same one
    const std::vector<index_t> steps = dp.comm->all_gather(static_cast<index_t>(step));
    for (std::size_t r = 0; r < steps.size(); ++r)
      if (steps[r] != steps[0])
        examples::throw_same_on_every_rank(
            "train_lm --resume", "rank ", r, " starts at step ", steps[r], " but rank 0 at step ",
            steps[0], ": every rank must see the same '", ckpt, "' (a shared output directory)");
    examples::broadcast_parameters(dp, lm.arena());  // everyone starts from rank 0's values
  }
  auto save = [&](std::int64_t at_step) {
    std::map<std::string, std::string> meta = {
        {"config", config_json(opt, mc).dump()}, {"step", std::to_string(at_step)},
        {"format", "graphmoe-lm-1"}, {"precision", opt.precision}};
    // the ids' meaning: train_lm's vocabulary, or (--hf) the Hugging Face directory's tokenizer
    if (data.hf) meta["hf"] = data.hf_record;
    else meta["vocabulary"] = data.vocabulary.json();
    // rank 0 writes (with --ep every rank takes part: the experts are gathered to rank 0)
    if (opt.keep_checkpoints)
      examples::save_training_state(dp, (fs::path(opt.out_dir) / ("checkpoint-step" + std::to_string(at_step) +
                                                                   ".safetensors")).string(),
                                    lm.arena(), adam, meta);
    examples::save_training_state(dp, ckpt, lm.arena(), adam, meta);
  };

  // metrics.csv: one row per evaluation; routing metrics per MoE layer on a fixed probe batch
  std::vector<std::string> cols = {"step", "train_loss", "val_loss", "val_ppl", "lr", "grad_norm", "tokens_per_s"};
  std::vector<index_t> moe_layers;
  for (index_t l = 0; l < mc.num_layers; ++l)
    if (mc.is_moe_layer(l)) moe_layers.push_back(l);
  for (index_t l : moe_layers)
    for (const char* m : {"entropy_r", "entropy_p", "graph_entropy", "fluctuation", "max_load_share"})
      cols.push_back("layer" + std::to_string(l) + "_" + m);
  std::optional<CsvLog> csv;  // rank 0's
  if (root) csv.emplace((fs::path(opt.out_dir) / "metrics.csv").string(), cols, opt.resume && step > 0);
  std::vector<Tensor<std::int32_t, cpu>> prev_probe(moe_layers.size());
  const LMBatch probe = valid.batch(0);
  const Tensor<std::int32_t, B> probe_inputs = examples::on_backend<B>(probe.inputs);
  const Tensor<std::int32_t, B> probe_targets = examples::on_backend<B>(probe.targets);

  auto order_for_epoch = [&](std::int64_t epoch) {
    Rng rng(opt.seed * 1000003ull + static_cast<std::uint64_t>(epoch));
    return train.order(rng);
  };
  const index_t nb = train.num_batches();
  std::vector<index_t> order = order_for_epoch(step / nb);
  ProgressBar bar(opt.steps, "train " + opt.router, step);
  const std::int64_t first_step = step;
  double loss_ema = 0, last_norm = 0, last_loss = 0;
  std::vector<double> last_fluctuation(moe_layers.size(), std::nan(""));
  const double tokens_per_step = static_cast<double>(opt.batch * seq);
  // divergence (docs/reliability.md): checked before each optimizer step and each save, so that a
  // diverged step never updates the weights and never overwrites the last checkpoint
  DivergenceGuard guard(examples::divergence_config(opt.divergence, static_cast<double>(mc.vocab_size)),
                        "train_lm");
  // --cuda-graph: the step's forward, zero_grad and backward replayed from a CUDA graph that reads
  // the batch from these two tensors (written in place every step); dropped before every
  // evaluation (which runs the model at its own shapes) and captured again after it
  examples::StepGraph<B> step_graph(opt.cuda_graph);
  Tensor<std::int32_t, B> graph_inputs, graph_targets;
  const auto train_start = std::chrono::steady_clock::now();
  for (; step < opt.steps; ++step) {
    if (step % nb == 0 && step > 0) order = order_for_epoch(step / nb);
    // with --dp, this rank's shard of the global batch every rank draws
    const LMBatch b = examples::shard(dp, train.batch(order[static_cast<std::size_t>(step % nb)]));
    lm.set_step(step);
    double loss = 0;
    examples::before_optimizer_step("train_lm", step + 1, [&] {
      if (step_graph.enabled()) {  // the loss is checked after the backward: still before the update
        if constexpr (std::is_same_v<B, cpu>) {
          graph_inputs = b.inputs;
          graph_targets = b.targets;
        } else {
          to_device(b.inputs, graph_inputs);  // in place once allocated: what the graph reads
          to_device(b.targets, graph_targets);
        }
        step_graph.run([&] {
          (void)lm.forward(graph_inputs, graph_targets);
          lm.arena().zero_grad();
          lm.backward();
        });
        loss = examples::mean_over_ranks(dp, lm.last_loss().total());
        guard.check_loss(step + 1, loss);
      } else {
        loss = lm.forward(examples::on_backend<B>(b.inputs), examples::on_backend<B>(b.targets)).total();
        loss = examples::mean_over_ranks(dp, loss);  // the whole batch's: the same guard everywhere
        guard.check_loss(step + 1, loss);
        lm.arena().zero_grad();
        lm.backward();
      }
      examples::average_gradients(dp, lm.arena());  // clipping sees the whole batch's gradient
      last_norm = examples::clip_checked(guard, step + 1, lm.arena(), opt.clip, [&](auto& a, double c) {
        return examples::clip_grad_norm(dp, a, c);  // with --ep, over every rank's experts
      });
    });
    const double lr = sched.at(step);
    adam.step(lm.arena(), lr, lm.compute_mirror());  // C != T: the bf16 weights in the same pass
    lm.after_optimizer_step(examples::routers_comm<B>(dp));  // stateful router policies (bias balancing): every rank
    last_loss = loss;
    loss_ema = step == first_step ? loss : 0.98 * loss_ema + 0.02 * loss;
    const double tps = tokens_per_step * static_cast<double>(step + 1 - first_step) /
                       std::max(1e-9, bar.elapsed_seconds());
    char stats[128];
    std::snprintf(stats, sizeof stats, "loss %.3f | %s tok/s", loss_ema, ProgressBar::si(tps).c_str());
    if (root) bar.update(step + 1, stats);

    const bool last = step + 1 == opt.steps;
    if ((opt.eval_every > 0 && (step + 1) % opt.eval_every == 0) || last) {
      step_graph.reset();
      const double vloss = evaluate<B>(lm, valid, opt.eval_batches, dp);
      guard.check_eval(step + 1, "validation loss", vloss);  // before the row and the save
      std::vector<double> row = {static_cast<double>(step + 1), last_loss, vloss, std::exp(vloss),
                                 lr, last_norm, tps};
      {
        ModeScope<Model> eval(lm, Mode::Eval);
        lm.forward(probe_inputs, probe_targets);
      }
      for (std::size_t i = 0; i < moe_layers.size(); ++i) {
        const auto& r = lm.block(moe_layers[i]).moe().routing();
        const Tensor<std::int32_t, cpu> indices = examples::host_values(r.selection.indices);
        const auto load = expert_load(indices, mc.router.num_experts);
        index_t mx = 0, tot = 0;
        for (index_t c : load) { mx = std::max(mx, c); tot += c; }
        double fl = std::nan("");
        if (!prev_probe[i].empty() && prev_probe[i].shape() == indices.shape())
          fl = routing_fluctuation(prev_probe[i], indices).changed_tokens;
        last_fluctuation[i] = fl;
        prev_probe[i] = indices.clone();
        row.insert(row.end(), {mean_score_entropy(examples::host_values(r.r)),
                               mean_score_entropy(examples::host_values(r.p)),
                               lm.block(moe_layers[i]).moe().router().graph_entropy(), fl,
                               tot > 0 ? static_cast<double>(mx) / static_cast<double>(tot) : 0.0});
      }
      if (root) {
        csv->row_or_missing(row);  // the first evaluation's fluctuation: an empty field
        bar.finish();
        std::fprintf(stderr, "step %lld  train loss %.4f  val loss %.4f  val ppl %.2f\n",
                     static_cast<long long>(step + 1), loss_ema, vloss, std::exp(vloss));
      }
    }
    if ((opt.checkpoint_every > 0 && (step + 1) % opt.checkpoint_every == 0) || last)
      save(step + 1);  // on every rank: rank 0 writes
  }
  const double train_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - train_start).count();
  if (root) bar.finish();
  step_graph.reset();
  if (root && step_graph.enabled())
    std::fprintf(stderr, "train_lm: --cuda-graph: %zu captures (one after each evaluation)\n",
                 step_graph.captures());
  if (dp.active()) {
    // the ranks must still hold the same parameters (checked once: it broadcasts the arena)
    const double divergence = examples::max_parameter_divergence(dp, lm.arena());
    if (divergence != 0)
      examples::throw_same_on_every_rank(
          "train_lm", "--dp ", dp.size(), ": after training, the ranks' parameters differ from "
          "rank 0's by up to ", divergence, " (they must be identical)");
    if (root)
      std::fprintf(stderr, "train_lm: data parallel over %d ranks: parameters identical on every rank\n",
                   dp.size());
  }
  const double vloss = evaluate<B>(lm, valid, 0, dp);
  guard.check_eval(step, "validation loss", vloss);
  // mean over MoE layers of the token graph's row entropy on the probe batch (0: no graph, or a
  // degenerate identity graph)
  lm.forward(probe_inputs, probe_targets);
  double graph_entropy = 0;
  for (index_t l : moe_layers) graph_entropy += lm.block(l).moe().router().graph_entropy();
  if (!moe_layers.empty()) graph_entropy /= static_cast<double>(moe_layers.size());
  // mean over MoE layers of the probe batch's fluctuation between the last two evaluations: NaN,
  // printed "n/a", when there were fewer than two (or no MoE layer)
  double fluctuation = moe_layers.empty() ? std::nan("") : 0.0;
  for (double f : last_fluctuation) fluctuation += f;
  if (!moe_layers.empty()) fluctuation /= static_cast<double>(moe_layers.size());
  if (root)
    std::printf("router=%s val_ppl=%.3f graph_entropy=%.3f fluctuation=%s", opt.router.c_str(),
                std::exp(vloss), graph_entropy, metric_text(fluctuation, 4).c_str());
  if (!data.test.empty()) {
    LMBatcher test(data.test, opt.batch, seq);
    const double test_loss = evaluate<B>(lm, test, 0, dp);
    guard.check_eval(step, "test loss", test_loss);
    if (root) std::printf(" test_ppl=%.3f", std::exp(test_loss));
    if (!data.attacked_test.empty()) {
      LMBatcher attacked(data.attacked_test, opt.batch, seq);
      const double attacked_loss = evaluate<B>(lm, test, 0, dp, &attacked);
      // an attack may legitimately raise the loss past the ceiling: only non-finite is an error
      GRAPHMOE_CHECK(std::isfinite(attacked_loss), "train_lm", "the attacked test loss is ",
                     attacked_loss, " after ", step, " steps");
      if (root) std::printf(" attacked_test_ppl=%.3f", std::exp(attacked_loss));
    }
  }
  if (root) std::printf("\n");
  if (root && opt.sample_tokens > 0 && data.detokenize) print_sample(lm, opt, data);
  if (root && !opt.save_hf.empty()) save_hf_model<Policy>(opt, data, lm);
  // the last line: the run's time, the training steps' tokens/s, and the checkpoint written
  if (root) {
    const double total =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const double trained = tokens_per_step * static_cast<double>(opt.steps - first_step);
    std::printf("train_lm: %lld steps in %.2f s (%.2f s in all), %.0f tokens/s, checkpoint %s\n",
                static_cast<long long>(opt.steps - first_step), train_seconds, total,
                train_seconds > 0 ? trained / train_seconds : 0.0, ckpt.c_str());
    std::fflush(stdout);
  }
  return 0;
}

// --precision: fp32 (the default, every backend) or bf16 (a backend with a bf16 compute type,
// examples::Bf16Compute: CUDA). Both models are instantiated in the backend's one translation
// unit; main() refuses bf16 on the CPU before any data is read, and this check repeats it.
template <class Policy, class B>
int run(const Options& opt, const Data& data) {
  using Bf16 = typename examples::Bf16Compute<B>::type;
  if (opt.precision == "bf16") {
    if constexpr (!std::is_void_v<Bf16>) {
      return run_model<Policy, B, Bf16>(opt, data);
    } else {
      GRAPHMOE_USER_CHECK(false, "train_lm", "--precision bf16 needs --device cuda (the ",
                          B::name, " backend computes in fp32)");
    }
  }
  return run_model<Policy, B, Scalar>(opt, data);
}

}  // namespace train_lm
