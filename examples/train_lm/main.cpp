// train_lm: train a decoder-only MoE transformer LM with any router on a word-level
// (WikiText format) or character-level corpus.
//
//   train_lm --train wiki.valid.tokens --test wiki.test.tokens --router similarity --steps 2000
//
// or fine-tune a Hugging Face model directory (its model, weights and tokenizer; the text encoded
// line by line, each line followed by the eos id: train_lm/hf_data.hpp), optionally graph-upcycled,
// and save it back in the same layout:
//
//   train_lm --hf path/to/model --train train.txt --valid valid.txt --save-hf out/model
//
// See `train_lm --help`. Metrics go to <out>/metrics.csv, the checkpoint (model + AdamW state,
// safetensors) to <out>/checkpoint.safetensors; --resume continues from it.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "common/cli_checks.hpp"
#include "common/data_parallel_world.hpp"
#include "common/device_dispatch.hpp"
#include "graphmoe/routing/registry.hpp"
#include "graphmoe/train/text_attack.hpp"
#include "train_lm/hf_data.hpp"
#include "train_lm/options.hpp"

using namespace graphmoe;

int main(int argc, char** argv) {
  train_lm::Options opt;
  auto& m = opt.model;
  // --arch: the family's preset (TransformerLMConfig::preset) gives every default below it, so
  // that the other options override single fields of it (and --help shows the preset's values)
  std::string arch = "gpt";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--arch" && i + 1 < argc) arch = argv[i + 1];
    else if (a.rfind("--arch=", 0) == 0) arch = a.substr(7);
  }
  const auto& archs = TransformerLMConfig::preset_names();
  if (arch != "gpt" && std::find(archs.begin(), archs.end(), arch) != archs.end()) {
    m = TransformerLMConfig::preset(arch, m.vocab_size);
  } else {
    m.max_seq_len = 128;
    m.d_model = 128;
    m.num_layers = 6;
    m.num_heads = 4;
    m.d_ff = 512;
    m.router.num_experts = 8;
    m.router.k = 2;
  }
  auto& choice = m.router.options<TopK>();  // TopK's token choice, read by BiasBalancedTopK too
  auto& bias_balanced = m.router.options<BiasBalancedTopK>();

  CLI::App app{"Train a graph-routed MoE transformer language model (graphmoe)"};
  std::string routers;
  const std::vector<std::string> built = examples::built_router_names();  // only these: --help and the check
  routers = examples::joined(built);
  // the options of the policies train_lm's routers use (the Similarity and Attention graphs,
  // SMoE-Dropout's schedule); a router ignores those of policies it does not have, since the one
  // command line configures every router (allow_unused_options)
  m.router.allow_unused_options = true;
  auto& sim = m.router.options<Similarity>();
  auto& sched = m.router.options<ScheduledTopK>();
  std::string layout = moe_layout_name(m.layout),
              tau_mode = "fixed", graph_precision = "exact",
              expert_layout = "compact";
  app.option_defaults()->always_capture_default();  // --help shows every default
  // a file that exists, or "" for none
  const CLI::Validator optional_file(
      [](std::string& t) { return t.empty() ? std::string() : CLI::ExistingFile(t); }, "FILE");
  std::string norm = norm_kind_name(m.norm), rope_layout = rope_layout_name(m.attention.rope_layout),
              qk_norm = name_of(kQKNormNames, m.attention.qk_norm);
  app.add_option("--arch", arch, "architecture preset, the defaults of every model option below (docs/reference/architectures.md)")->check(CLI::IsMember(archs));
  std::string activation = ffn_activation_name(m.activation);
  app.add_option("--activation", activation, "feed-forward activation: gelu, or swiglu (fused gate|up projection)")->check(CLI::IsMember(names_of(kFfnActivationNames)));
  app.add_option("--ffn-bias", m.ffn_bias, "biases of the feed-forward networks and experts (true/false)");
  app.add_option("--norm", norm, "normalisation: layernorm or rmsnorm")->check(CLI::IsMember(names_of(kNormKindNames)));
  app.add_option("--norm-eps", m.norm_eps, "the norms' epsilon")->check(examples::real(1e-12, 0.5));
  app.add_option("--kv-heads", m.attention.num_kv_heads, "key/value heads, dividing --heads (grouped-query; 1: multi-query; 0: --heads)")->check(examples::integer<index_t>(0, examples::kMaxHeads));
  app.add_option("--head-dim", m.attention.head_dim, "each attention head's width (0: --d-model / --heads)")->check(examples::integer<index_t>(0, examples::kMaxWidth));
  app.add_option("--kv-lora-rank", m.attention.kv_lora_rank, "> 0: multi-head latent attention (DeepSeek-V2/V3) with a key/value latent this wide; needs --rope-theta, --qk-nope-head-dim, --qk-rope-head-dim, --v-head-dim")->check(examples::integer<index_t>(0, examples::kMaxWidth));
  app.add_option("--q-lora-rank", m.attention.q_lora_rank, "multi-head latent attention: the query latent's width (0: queries straight from the input)")->check(examples::integer<index_t>(0, examples::kMaxWidth));
  app.add_option("--qk-nope-head-dim", m.attention.qk_nope_head_dim, "multi-head latent attention: each head's key/query width without RoPE")->check(examples::integer<index_t>(0, examples::kMaxWidth));
  app.add_option("--qk-rope-head-dim", m.attention.qk_rope_head_dim, "multi-head latent attention: the rotary key/query width (even; one rotary key shared by the heads)")->check(examples::integer<index_t>(0, examples::kMaxWidth));
  app.add_option("--v-head-dim", m.attention.v_head_dim, "multi-head latent attention: each head's value width (at most --qk-nope-head-dim + --qk-rope-head-dim)")->check(examples::integer<index_t>(0, examples::kMaxWidth));
  app.add_option("--rope-theta", m.attention.rope_theta, "rotary position embeddings' base (0: learned positions)")->check(examples::real(0, 1e12));
  app.add_option("--rope-layout", rope_layout, "RoPE's pairs: half-split (Hugging Face's rotate_half) or interleaved")->check(CLI::IsMember(names_of(kRopeLayoutNames)));
  app.add_option("--qk-norm", qk_norm, "RMSNorm of queries and keys: none, full (over the projection, OLMoE) or per-head (Qwen3)")->check(CLI::IsMember(names_of(kQKNormNames)));
  app.add_option("--qkv-bias", m.attention.qkv_bias, "biases of the q, k, v projections (true/false)");
  app.add_option("--out-bias", m.attention.out_bias, "bias of the attention output projection (true/false)");
  app.add_option("--tie-embeddings", m.tie_embeddings, "the LM head is the token embedding (true/false)");
  app.add_option("--expert-d-ff", m.expert_d_ff, "the routed experts' hidden size (0: --d-ff)")->check(examples::integer<index_t>(0, examples::kMaxWidth));
  app.add_option("--shared-d-ff", m.shared_d_ff, "shared experts' total hidden size in every MoE block (0: none)")->check(examples::integer<index_t>(0, examples::kMaxWidth));
  app.add_option("--shared-expert-gate", m.shared_expert_gate, "a per-token sigmoid gate on the shared experts (true/false)");
  app.add_option("--first-dense", m.first_k_dense, "the first N blocks dense")->check(examples::integer<index_t>(0, examples::kMaxLayers));
  app.add_option("--moe-every", m.moe_every, "switch layout: MoE in every N-th block")->check(examples::integer<index_t>(1, examples::kMaxLayers));
  app.add_option("--router-bias", m.router.options<LinearScorer>().bias, "bias b of the linear router's scores W u + b (true/false; the modern presets: false)");
  app.add_option("--norm-topk-prob", choice.norm_topk_prob, "gates renormalised over the chosen k (true/false)");
  app.add_option("--routed-scaling-factor", choice.routed_scaling_factor, "every gate times this")->check(examples::positive_real(examples::kMaxCoef));
  app.add_option("--n-group", choice.n_group, "group-limited routing: expert groups (1: off)")->check(examples::integer<index_t>(1, examples::kMaxExperts));
  app.add_option("--topk-group", choice.topk_group, "group-limited routing: groups a token may use")->check(examples::integer<index_t>(1, examples::kMaxExperts));
  app.add_option("--bias-update-rate", bias_balanced.bias_update_rate, "sigmoid-bias routers: the expert bias's step per optimizer step")->check(examples::real(0, examples::kMaxCoef));
  app.add_option("--train", opt.train_path, "training text (WikiText format, e.g. WikiText-2's wiki.valid.tokens, or any text with --char)")->required()->check(CLI::ExistingFile);
  app.add_option("--valid", opt.valid_path, "validation text (none: the last --valid-fraction of --train)")->check(optional_file);
  app.add_option("--test", opt.test_path, "test text, reported at the end (none: no test)")->check(optional_file);
  app.add_option("--valid-fraction", opt.valid_fraction, "share of the training stream held out when no --valid")->check(examples::real(0.001, 0.5));
  app.add_flag("--char", opt.char_level, "character-level tokens instead of words");
  std::string normalise = "none";
  app.add_option("--normalise", normalise, "how the text is read before it is split, recorded in the checkpoint so that generate reads prompts the same way: none, lower (ASCII lowercase), punct (word level: . , ; : ! ? ( ) and 's split off as words, as scripts/prepare-kjv.sh did), lower,punct")->check(CLI::IsMember({"none", "lower", "punct", "lower,punct"}));
  app.add_option("--max-vocab", opt.max_vocab, "word level: keep the most frequent words (0 = all)")->check(examples::integer<std::size_t>(0, examples::kMaxCount));
  app.add_option("--router", opt.router, "router: " + routers)->check(CLI::IsMember(built));
  app.add_option("--layout", layout, "MoE layout: switch (every FFN), glam (every other), dense")->check(CLI::IsMember(names_of(kMoELayoutNames)));
  app.add_option("--layers", m.num_layers, "transformer blocks")->check(examples::integer<index_t>(1, examples::kMaxLayers));
  app.add_option("--d-model", m.d_model, "model width D")->check(examples::integer<index_t>(1, examples::kMaxWidth));
  app.add_option("--heads", m.num_heads, "attention heads")->check(examples::integer<index_t>(1, examples::kMaxHeads));
  app.add_option("--d-ff", m.d_ff, "expert / FFN hidden size")->check(examples::integer<index_t>(1, examples::kMaxWidth));
  app.add_option("--experts", m.router.num_experts, "experts per MoE layer E")->check(examples::integer<index_t>(1, examples::kMaxExperts));
  app.add_option("--top-k", m.router.k, "experts per token k")->check(examples::integer<index_t>(1, examples::kMaxExperts));
  app.add_option("--seq", m.max_seq_len, "sequence length")->check(examples::integer<index_t>(1, examples::kMaxSeq));
  app.add_option("--tau", sim.tau, "Similarity graph temperature (paper: 1)")->check(examples::positive_real(examples::kMaxCoef));
  app.add_option("--tau-mode", tau_mode, "fixed: tau; scaled: tau * sqrt(D); learned: a trained temperature per layer starting at tau")->check(CLI::IsMember(names_of(kTauModeNames)));
  app.add_flag("--graph-exclude-self", sim.exclude_self, "Similarity graph: leave S[i,i] out of each row");
  app.add_flag("--graph-projection", sim.projection, "Similarity graph on a learned bilinear form: S = softmax(U W_s U^T / tau), W_s from the identity");
  app.add_option("--graph-precision", graph_precision, "token graphs' (T, T) products: exact; tf32 or bf16 on CUDA tensor cores (both graphs)")->check(CLI::IsMember(names_of(kGraphPrecisionNames)));
  app.add_option("--sigma", m.router.options<Attention>().sigma, "Attention graph sigma (paper: 1)")->check(examples::positive_real(examples::kMaxCoef));
  app.add_option("--capacity-factor", m.router.capacity_factor, "expert capacity: each MoE layer's expert takes at most ceil(f N k / E) of a batch's N k assignments, the rest dropped in token order (0: dropless, the default)")->check(examples::real(0, examples::kMaxCoef));
  app.add_option("--expert-layout", expert_layout, "the experts' rows: compact (sorted by expert, N k rows), or padded (E blocks of the capacity: needs --capacity-factor > 0; on a GPU no read back to the host per layer, E C rows of expert work)")->check(CLI::IsMember(names_of(kExpertLayoutNames)));
  app.add_option("--load-balance", m.router.load_balance_coef, "Switch load-balancing loss coefficient")->check(examples::real(0, examples::kMaxCoef));
  app.add_option("--z-loss", m.router.z_loss_coef, "router z-loss coefficient")->check(examples::real(0, examples::kMaxCoef));
  app.add_option("--seq-aux-loss-coef", m.router.seq_aux_loss_coef, "DeepSeek-V3's sequence-wise balance loss coefficient (deepseek-v3 preset: 1e-4)")->check(examples::real(0, examples::kMaxCoef));
  app.add_option("--k-min", sched.k_min, "SMoE-Dropout: first k of the schedule")->check(examples::integer<index_t>(1, examples::kMaxExperts));
  app.add_option("--k-max", sched.k_max, "SMoE-Dropout: last k of the schedule")->check(examples::integer<index_t>(1, examples::kMaxExperts));
  app.add_option("--steps", opt.steps, "optimizer steps")->check(examples::integer<std::int64_t>(1, examples::kMaxSteps));
  app.add_option("--batch", opt.batch, "sequences per batch (with --dp N: the global batch, a multiple of N)")->check(examples::integer<index_t>(1, examples::kMaxBatch));
  app.add_option("--lr", opt.lr, "peak learning rate (AdamW)")->check(examples::positive_real(examples::kMaxLR));
  examples::add_divergence_options(app, opt.divergence);
  app.add_option("--min-lr", opt.min_lr, "final learning rate of the cosine schedule")->check(examples::real(0, examples::kMaxLR));
  app.add_option("--warmup", opt.warmup, "linear warmup steps")->check(examples::integer<std::int64_t>(0, examples::kMaxSteps));
  app.add_option("--weight-decay", opt.weight_decay, "AdamW decoupled weight decay")->check(examples::real(0, examples::kMaxLR));
  app.add_option("--clip", opt.clip, "global gradient-norm clip (0 = off)")->check(examples::real(0, examples::kMaxCoef));
  app.add_option("--eval-every", opt.eval_every, "evaluate every N steps (0 = only at the end)")->check(examples::integer<std::int64_t>(0, examples::kMaxSteps));
  app.add_option("--eval-batches", opt.eval_batches, "validation batches per periodic evaluation (0 = all)")->check(examples::integer<index_t>(0, examples::kMaxCount));
  app.add_option("--checkpoint-every", opt.checkpoint_every, "checkpoint every N steps (0 = at the end)")->check(examples::integer<std::int64_t>(0, examples::kMaxSteps));
  app.add_option("--seed", opt.seed, "random seed (initialisation and data order)")->check(examples::seed());
  app.add_option("--threads", opt.threads, "CPU threads")->check(examples::threads());
  app.add_option("--dp", opt.dp.ranks, "data parallel over N MPI processes (mpirun -n N ... --dp N; docs/distributed.md)")->check(examples::integer<int>(1, examples::kMaxRanks));
  app.add_option("--ep", opt.dp.experts, "expert parallel: split every MoE layer's experts over the --dp ranks (1, or the --dp N; --experts a multiple of N)")->check(examples::integer<int>(1, examples::kMaxRanks));
  app.add_option("--device", opt.device, examples::device_help())->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--cuda-graph", opt.cuda_graph, "replay each step's forward and backward from a CUDA graph (one launch instead of hundreds): --device cuda, --expert-layout padded, a router with a fixed k (not smoe-dropout); captured after one eager step and again after each evaluation");
  app.add_option("--precision", opt.precision, "fp32, or bf16 with --device cuda: every GEMM (projections, experts, LM head) on bf16 operands with fp32 accumulation; fp32 master weights, optimizer state, LayerNorm, softmax and routers")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--out", opt.out_dir, "output directory (metrics.csv, checkpoint.safetensors)");
  app.add_flag("--resume", opt.resume, "continue from <out>/checkpoint.safetensors if present");
  app.add_option("--upcycle-from", opt.upcycle_from, "start from this train_lm checkpoint's weights (same vocabulary): the same model, its dense blocks as MoE blocks whose experts copy the dense FFN (--norm-topk-prob true), or its softmax router graph-aware (--router blended-similarity / blended-attention, from a = 0); the same model at step 0. Ignored when --resume finds a checkpoint")->check(CLI::ExistingFile);
  app.add_option("--hf", opt.hf_dir, "fine-tune a Hugging Face model directory (docs/reference/hugging-face.md): its config.json fixes the model (the model-shape flags are refused), its weights start the run (not when --resume finds a checkpoint), its tokenizer encodes every non-empty line of the text followed by the eos id; --router softmax (the model's own), blended-similarity / blended-attention (graph upcycling from a = 0: the same model at step 0) or similarity / attention (the graph applied to the pretrained weights at once: another model); --seq at most its max_position_embeddings");
  app.add_option("--save-hf", opt.save_hf, "with --hf: at the end, save the trained model to this new directory in the Hugging Face layout (config.json with the input's keys and token ids, the weights, and the input's tokenizer files), which transformers and --hf load");
  app.add_option("--save-hf-dtype", opt.save_hf_dtype, "--save-hf's weights: input (config.json's dtype; F32 when it names none or float64), f32, bf16 or f16")->check(CLI::IsMember({"input", "f32", "bf16", "f16"}));
  app.add_flag("--save-hf-drop-graph", opt.save_hf_drop_graph, "--save-hf with a graph router: write its linear router's weights and drop the token graph, which transformers cannot express (the saved model then routes as the softmax router, without the graph: not the model trained)");
  app.add_option("--sample-tokens", opt.sample_tokens, "tokens of the sample printed at the end (0: none)")->check(examples::integer<index_t>(0, 100000));
  app.add_option("--sample-prompt", opt.sample_prompt, "the sample's prompt: this many tokens from the start of the validation text")->check(examples::integer<index_t>(1, 100000));
  app.add_flag("--keep-checkpoints", opt.keep_checkpoints, "also keep <out>/checkpoint-step<N>.safetensors at every checkpoint (routing_report compares them)");
  app.add_option("--attack-rate", opt.attack_rate, "robustness: also report the test perplexity with this share of the input words replaced by --attack-word, targets clean (paper: 0.1; 0 = off)")->check(examples::real(0, 1));
  app.add_option("--attack-seed", opt.attack_seed, "seed choosing the attacked positions")->check(examples::seed());
  app.add_option("--attack-word", opt.attack_word, "the replacement word (paper: AAA; out-of-vocabulary words become <unk>)");
  CLI11_PARSE(app, argc, argv);

  // the names to values (IsMember above accepted only the tables' names)
  m.layout = moe_layout_from_name(layout);
  m.norm = norm_kind_from_name(norm);
  m.activation = ffn_activation_from_name(activation);
  m.attention.rope_layout = rope_layout_from_name(rope_layout);
  m.attention.qk_norm = qk_norm_from_name(qk_norm);
  m.expert_layout = expert_layout_from_name(expert_layout);
  sim.precision = graph_precision_from_name(graph_precision);
  m.router.options<Attention>().precision = sim.precision;
  sim.tau_mode = tau_mode_from_name(tau_mode);
  if (opt.router.rfind("smoe-dropout", 0) == 0) {
    sched.k_max = std::max(sched.k_max, m.router.k);
    sched.schedule_steps = opt.steps;
  }
  examples::DataParallelWorld world(argc, argv, "train_lm", opt.dp);
  try {
    world.check();
    // --save-hf's checks, before anything is read or trained
    GRAPHMOE_CHECK(!opt.save_hf.empty() || (!app.count("--save-hf-dtype") && !opt.save_hf_drop_graph),
                   "train_lm", "--save-hf-dtype and --save-hf-drop-graph are options of --save-hf");
    if (!opt.save_hf.empty()) {
      GRAPHMOE_CHECK(!opt.hf_dir.empty(), "train_lm", "--save-hf needs --hf (the Hugging Face "
                     "model's family and keys; a train_lm model saves with graphmoe::hf::save_lm)");
      GRAPHMOE_CHECK(opt.router == "softmax" || opt.router == "sigmoid-bias" ||
                         opt.save_hf_drop_graph,
                     "train_lm", "--save-hf with --router ", opt.router, ": its token graph cannot be expressed in a "
                     "transformers model. Pass --save-hf-drop-graph to save its linear router's "
                     "weights without the graph (the saved model then routes as the softmax router "
                     "does, without the graph, so it is not the model trained), or keep "
                     "<out>/checkpoint.safetensors for the graph-routed model");
      std::error_code ec;
      GRAPHMOE_CHECK(!std::filesystem::exists(opt.save_hf, ec) ||
                         (std::filesystem::is_directory(opt.save_hf, ec) &&
                          std::filesystem::is_empty(opt.save_hf, ec)),
                     "train_lm", "--save-hf '", opt.save_hf, "' exists and is not an empty "
                     "directory: name a new one (it is not replaced)");
    }
    if (opt.dp.experts > 1) {
      if (opt.dp.experts != opt.dp.ranks)
        examples::throw_same_on_every_rank(
            "train_lm", "--ep ", opt.dp.experts, " must be 1 or equal --dp ", opt.dp.ranks,
            ": the experts are split over all the data-parallel ranks (expert groups smaller than "
            "the world are not built)");
      if (opt.model.router.num_experts % opt.dp.experts != 0)
        examples::throw_same_on_every_rank(
            "train_lm", "--experts ", opt.model.router.num_experts, " is not a multiple of --ep ",
            opt.dp.experts, ": every rank holds the same number of experts");
    }
    examples::check_data_parallel("train_lm", opt.dp, opt.batch, opt.device, "sequences");
    if (opt.precision == "bf16" && opt.device != "cuda")
      examples::throw_same_on_every_rank(
          "train_lm", "--precision bf16 needs --device cuda (mixed precision runs the GEMMs on "
          "the GPU's bf16 tensor cores; --device ", opt.device, " computes in fp32)");
    examples::require_cpu_router("train_lm", opt.router, opt.device);
    if (opt.cuda_graph) {
      if (opt.device != "cuda")
        examples::throw_same_on_every_rank(
            "train_lm", "--cuda-graph needs --device cuda (a CUDA graph replays GPU work; --device ",
            opt.device, " has none)");
      if (m.expert_layout != ExpertLayout::Padded)
        examples::throw_same_on_every_rank(
            "train_lm", "--cuda-graph needs --expert-layout padded (and --capacity-factor > 0): the "
            "compact layout reads the experts' sizes back to the host in every MoE layer, which a "
            "graph cannot hold");
      if (opt.router.rfind("smoe-dropout", 0) == 0)
        examples::throw_same_on_every_rank(
            "train_lm", "--cuda-graph needs a router with a fixed k (", opt.router,
            " schedules k over the steps, and a graph replays the k it was captured with)");
      if (opt.dp.experts > 1)
        examples::throw_same_on_every_rank(
            "train_lm", "--cuda-graph with --ep: the experts' exchange goes through the host");
    }
    if (m.expert_layout == ExpertLayout::Padded && !(m.router.capacity_factor > 0))
      examples::throw_same_on_every_rank(
          "train_lm", "--expert-layout padded needs --capacity-factor > 0 (each expert's block is "
          "its capacity; without one an expert can receive every assignment)");
    train_lm::Data data;
    std::vector<std::int32_t> stream;
    auto split_valid = [&] {
      if (!opt.valid_path.empty()) return;
      const std::size_t cut = static_cast<std::size_t>(static_cast<double>(data.train.size()) * (1.0 - opt.valid_fraction));
      data.valid.assign(data.train.begin() + static_cast<std::ptrdiff_t>(cut), data.train.end());
      data.train.resize(cut);
    };
    GRAPHMOE_CHECK(opt.attack_rate == 0.0 || !opt.test_path.empty(), "train_lm",
                   "--attack-rate needs a test set (--test)");
    // The similarity graph's options on a router without it would be silently ignored.
    GRAPHMOE_CHECK((sim.tau_mode != TauMode::Learned && !sim.exclude_self && !sim.projection) ||
                       opt.router.find("similarity") != std::string::npos,
                   "train_lm", "--tau-mode learned, --graph-exclude-self and --graph-projection are options of the "
                   "Similarity graph; the router '", opt.router, "' has none");
    auto attack = [&](std::int32_t word, std::vector<std::int32_t> keep, const char* word_text) {
      if (opt.attack_rate == 0.0) return;
      GRAPHMOE_CHECK(std::find(keep.begin(), keep.end(), word) == keep.end(), "train_lm",
                     "--attack-word '", opt.attack_word, "' is a line break, not a word");
      AttackStats st;
      data.attacked_test = attack_stream(data.test, opt.attack_rate, word, opt.attack_seed, keep, &st);
      GRAPHMOE_CHECK(st.replaced > 0, "train_lm", "--attack-rate ", opt.attack_rate,
                     " replaces no word of the ", st.attackable, " test words: raise it or set 0");
      if (opt.dp.root())
        std::fprintf(stderr, "train_lm: attacked test: %zu of %zu words replaced by '%s' (id %d), seed %llu\n",
                     st.replaced, st.attackable, word_text, static_cast<int>(word),
                     static_cast<unsigned long long>(opt.attack_seed));
    };
    const TextNormalisation norm = TextNormalisation::parse(normalise);
    GRAPHMOE_CHECK(!opt.char_level || !norm.split_punct, "train_lm", "--normalise ", normalise,
                   " splits punctuation into words: with --char use none or lower");
    data.vocabulary.char_level = opt.char_level;
    data.vocabulary.normalisation = norm;
    data.vocabulary.file = (std::filesystem::absolute(opt.out_dir) / "vocab.txt").lexically_normal().string();
    // the character or word tokenizer (shared with data.detokenize): the texts encoded, vocab.txt
    auto encode_with = [&](const auto& tokp) {
      data.detokenize = [tokp](const std::vector<std::int32_t>& ids) { return tokp->decode(ids); };
      data.train = tokp->encode_file(opt.train_path);
      if (!opt.valid_path.empty()) data.valid = tokp->encode_file(opt.valid_path);
      if (!opt.test_path.empty()) data.test = tokp->encode_file(opt.test_path);
      data.vocab_size = tokp->size();
      data.vocabulary.fingerprint = tokp->fingerprint();
      if (opt.dp.root()) {  // the other ranks write nothing
        std::filesystem::create_directories(opt.out_dir);
        tokp->save(opt.out_dir + "/vocab.txt");
      }
    };
    if (!opt.hf_dir.empty()) {
      train_lm::load_hf(opt, data, [&](const std::string& flag) { return app.count(flag) > 0; });
    } else if (opt.char_level) {
      const auto tokp = std::make_shared<const CharTokenizer>(CharTokenizer::build(opt.train_path, norm));
      const CharTokenizer& tok = *tokp;
      encode_with(tokp);
      const std::vector<std::int32_t> w = tok.encode(opt.attack_word);
      GRAPHMOE_CHECK(opt.attack_rate == 0.0 || w.size() == 1, "train_lm",
                     "--attack-word must be one character with --char, got '", opt.attack_word, "'");
      // line breaks are kept, as <eos> is at word level
      const std::vector<std::int32_t> newline = tok.encode("\n");
      if (opt.attack_rate > 0.0) attack(w.front(), newline, opt.attack_word.c_str());
    } else {
      const auto tokp = std::make_shared<const WordTokenizer>(WordTokenizer::build(opt.train_path, opt.max_vocab, 1, norm));
      const WordTokenizer& tok = *tokp;
      encode_with(tokp);
      const std::vector<std::int32_t> w = tok.encode_line(opt.attack_word);
      GRAPHMOE_CHECK(opt.attack_rate == 0.0 || w.size() == 1, "train_lm",
                     "--attack-word must be one word, got '", opt.attack_word, "'");
      if (opt.attack_rate > 0.0)
        attack(w.front(), {tok.eos()}, tok.contains(opt.attack_word) ? opt.attack_word.c_str() : "<unk>");
    }
    data.vocabulary.size = data.vocab_size;
    split_valid();
    if (opt.dp.root())
      std::fprintf(stderr, "train_lm: router %s, %zu train / %zu valid / %zu test tokens, vocabulary %zu\n",
                   opt.router.c_str(), data.train.size(), data.valid.size(), data.test.size(), data.vocab_size);
    return with_router(opt.router, [&]<class Policy>() {
      return examples::on_device<Policy>("train_lm", opt.device, opt.router, [&]<class B>() {
        return train_lm::run<Policy, B>(opt, data);
      });
    });
  } catch (const std::exception& e) {
    return world.fail(e);
  }
}
