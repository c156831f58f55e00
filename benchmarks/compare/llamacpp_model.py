#!/usr/bin/env python3
"""The model of the llama.cpp comparison (benchmarks/compare/llamacpp_decode.sh): an OLMoE-family
model (OlmoeForCausalLM) at the olmoe preset's CPU benchmark shape, random weights, written by
transformers' save_pretrained in float32, with a byte-level BPE tokenizer that llama.cpp's
converter (convert_hf_to_gguf.py) accepts.

    ~/.cache/graphmoe/venv-torch/bin/python benchmarks/compare/llamacpp_model.py OUT_DIR [--vocab 10000]

Shape: the olmoe preset's (TransformerLMConfig::olmoe, bench_decode's olmoe cases and
docs/benchmarks.md's "The olmoe preset against PyTorch"): 4 blocks, hidden 256, 8 heads (and 8
key/value heads), 64 experts of width 128, top-8 with unnormalised gates (norm_topk_prob false),
RMSNorm eps 1e-5, RoPE base 10000, QK-norm, untied head, max_position_embeddings 576 (a 512-token
prompt plus 64), vocabulary 10,000 (bench_decode's; --vocab changes it). Weights: every parameter
drawn with a fixed seed as scripts/hf-fixtures.py draws them (matrices N(0, 1/fan_in), norm gains
1 + 0.2 N(0, 1)), so that logits and routing choices are far from ties.

Tokenizer: tokenizers' BPE with the GPT-2 byte-level pre-tokenizer, trained on a deterministic
corpus of random words until it has exactly `vocab` entries (so every id of the model is a real
token with text; the converter would otherwise pad the vocabulary with [PADi] tokens), saved
with PreTrainedTokenizerFast.save_pretrained (tokenizer.json, tokenizer_config.json). No BOS is
added to prompts. The text means nothing (random weights); token ids are what is compared.
"""
import argparse
import json
import math
import os
import random
import shutil

import torch
import transformers
from transformers import OlmoeConfig, OlmoeForCausalLM, PreTrainedTokenizerFast

SEED = 20261202


def corpus(n_words, seed):
    """Deterministic text: random lower-case words of 2-9 letters, Zipf-like repetition."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(n_words)]
    lines = []
    for i in range(0, 4 * n_words, 12):
        lines.append(" ".join(words[min(int(rng.paretovariate(0.7)) - 1, n_words - 1)
                                    if rng.random() < 0.5 else rng.randrange(n_words)]
                              for _ in range(12)))
    return lines


def make_tokenizer(vocab, out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|padding|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=1, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(60000, SEED), trainer=trainer)
    if tok.get_vocab_size() != vocab:
        raise SystemExit(f"llamacpp_model: the tokenizer has {tok.get_vocab_size()} tokens, "
                         f"not {vocab}: a larger corpus is needed")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|padding|>")
    fast.save_pretrained(out_dir)
    return tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|padding|>")


def draw_weights(model, gen):
    """As scripts/hf-fixtures.py: norms near 1, biases around 0, matrices N(0, 1 / fan_in)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--vocab", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shutil.rmtree(args.out_dir, ignore_errors=True)
    os.makedirs(args.out_dir)
    eos, pad = make_tokenizer(args.vocab, args.out_dir)
    config = OlmoeConfig(vocab_size=args.vocab, hidden_size=256, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=576, rms_norm_eps=1e-5, rope_theta=10000.0,
                         num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos,
                         pad_token_id=pad)
    torch.manual_seed(args.seed)
    model = OlmoeForCausalLM(config).eval()
    draw_weights(model, torch.Generator().manual_seed(args.seed))
    model.to(torch.float32).save_pretrained(args.out_dir)
    n = sum(p.numel() for p in model.parameters())
    with open(os.path.join(args.out_dir, "graphmoe_model.json"), "w") as f:
        json.dump({"parameters": n, "seed": args.seed, "vocab": args.vocab,
                   "transformers": transformers.__version__, "torch": torch.__version__}, f)
        f.write("\n")
    print(f"llamacpp_model: {args.out_dir}: OlmoeForCausalLM, {n} parameters, vocab {args.vocab}, "
          f"transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
