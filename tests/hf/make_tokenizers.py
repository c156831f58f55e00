#!/usr/bin/env python3
"""Trains the tokenizers of tests/hf/test_hf_tokenizer.cpp and writes their reference outputs.

    make_tokenizers.py OUT_DIR

Needs the PyPI packages `tokenizers` and `sentencepiece` (scripts/install-deps.sh installs both for
/usr/bin/python3) and Debian's King James Bible (bible-kjv, bible-kjv-text: the `bible` program
reads /usr/lib/bible.data). Nothing is downloaded.

The corpus is every verse, one per line, without its reference. Every third verse (the first
10,000 of them) is held out; the tokenizers train on the others. Each tokenizer directory
OUT_DIR/<name>/ holds what save_pretrained writes (tokenizer.json, or tokenizer.model) and
tokenizer_config.json; OUT_DIR/<name>.ref.json holds the reference library's outputs on
OUT_DIR/lines.json (the held-out verses, then hostile edge lines); OUT_DIR/done is written last:
  ids        encode(line) with the special tokens the post-processor adds
  ids_plain  encode(line, add_special_tokens=False)
  decoded    decode(ids), skip_special_tokens=False
  skipped    decode(ids), skip_special_tokens=True
  random_ids / random_decoded   decode of random id sequences (invalid UTF-8 in byte tokens, ...)
  bos, eos, pad                 token_to_id of the tokens tokenizer_config.json names
Variants (`<base>+<change>`) edit a trained tokenizer.json the way other families' files differ,
and are checked on the first 2,000 held-out lines and the edge lines.
"""
import json
import os
import random
import subprocess
import sys
import time

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)
import sentencepiece as spm

GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

EDGE_LINES = [
    "", " ", "   ", "\n", "\n\n", " \n ", "\t\tindented", "trailing spaces   ",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9", "Cafe\u0301 (decomposed e + U+0301)",
    "\u00c5ngstr\u00f6m \u212bngstr\u00f6m", "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e",
    "emoji \U0001F600\U0001F44D\U0001F3FD and \U0001F468\u200d\U0001F469\u200d\U0001F467",
    "\u0391\u03b2\u03b3 \u0414\u0436\u0438 \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",
    "math \U0001D518\U0001D52B\U0001D526 \u221e \u2211", "zero\u200bwidth\ufeffbom",
    "<|endoftext|>", "a<|endoftext|>b", "<|im_start|>user\nIn the beginning<|im_end|>\n",
    "<s>", "</s>", "<s> In the beginning </s>", "x<s>y", "<unk>", "<0x41>",
    "the LORD God said", "LORD Godly", " the LORD God ", "<|tool|>run<|tool|>",
    "It's we've they're I'm you'll he'd IT'S", "12345678901234 3.14159 1,000,000",
    "line one\nline two\r\nline three\r", "multiple     spaces\tand\ttabs",
    "\u00a0non-breaking\u00a0space\u2003em space", "\u2581already\u2581metaspaced",
    "'s 't", "!!!???...,,,", "a" * 300, "\U0010FFFF\ue000 private use",
    "In the beginning God created the heaven and the earth." * 5,
]


def corpus():
    out = subprocess.run(["bible", "-f", "-p", "/usr/lib", "Gen1:1-Rev22:21"], check=True,
                         capture_output=True, text=True).stdout
    lines = []
    for line in out.split("\n"):
        ref, _, verse = line.partition(" ")
        if verse:
            lines.append(verse)
    if len(lines) < 30000:
        sys.exit(f"make_tokenizers: the bible program printed {len(lines)} verses, not ~31,000")
    return lines


def save_dir(out, name):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    return d


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False)


def tokenizer_config(d, bos, eos, pad):
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
           "bos_token": bos, "eos_token": {"content": eos, "__type": "AddedToken"} if eos else None,
           "pad_token": pad}
    write_json(os.path.join(d, "tokenizer_config.json"), cfg)


def random_id_sequences(vocab_size, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(300)]


def reference_hf(tok, lines, bos, eos, pad):
    ids = [e.ids for e in tok.encode_batch(lines, add_special_tokens=True)]
    plain = [e.ids for e in tok.encode_batch(lines, add_special_tokens=False)]
    rnd = random_id_sequences(tok.get_vocab_size(), 7)
    return {
        "ids": ids, "ids_plain": plain,
        "decoded": tok.decode_batch(ids, skip_special_tokens=False),
        "skipped": tok.decode_batch(ids, skip_special_tokens=True),
        "random_ids": rnd,
        "random_decoded": tok.decode_batch(rnd, skip_special_tokens=False),
        "vocab_size": tok.get_vocab_size(),
        "bos": tok.token_to_id(bos) if bos else None,
        "eos": tok.token_to_id(eos) if eos else None,
        "pad": tok.token_to_id(pad) if pad else None,
    }


def write_hf(out, name, tok, lines, bos, eos, pad, edit=None):
    d = save_dir(out, name)
    path = os.path.join(d, "tokenizer.json")
    tok.save(path)
    if edit is not None:  # rewrite the saved file, then let the library read the edited one back
        with open(path, encoding="utf-8") as f:
            j = json.load(f)
        edit(j)
        write_json(path, j)
        tok = Tokenizer.from_file(path)
    tokenizer_config(d, bos, eos, pad)
    write_json(os.path.join(out, name + ".ref.json"), reference_hf(tok, lines, bos, eos, pad))
    return tok


def train_bpe(train, pre, special, vocab_size, **model_args):
    tok = Tokenizer(models.BPE(**model_args))
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  show_progress=False, **(
                                      {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()}
                                      if isinstance(pre, pre_tokenizers.ByteLevel) or
                                      isinstance(pre, pre_tokenizers.Sequence) else
                                      {"limit_alphabet": 70}))
    tok.train_from_iterator(train, trainer=trainer)
    return tok


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    stamp = os.path.join(out, "done")
    if os.path.exists(stamp):
        os.remove(stamp)
    t0 = time.time()
    verses = corpus()
    held = [v for i, v in enumerate(verses) if i % 3 == 0][:10000]
    train = [v for i, v in enumerate(verses) if i % 3 != 0]
    lines = held + EDGE_LINES
    few = held[:2000] + EDGE_LINES
    write_json(os.path.join(out, "lines.json"), lines)
    write_json(os.path.join(out, "lines_few.json"), few)

    # GPT-2 / OLMoE: ByteLevel pre-tokenizer with its regex; merges in the "a b" string form.
    gpt2 = train_bpe(train, pre_tokenizers.ByteLevel(add_prefix_space=False), ["<|endoftext|>"],
                     3000)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.post_processor = processors.ByteLevel(trim_offsets=False)
    gpt2.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    gpt2.add_tokens([AddedToken("LORD God", single_word=True), AddedToken("<|tool|>")])

    def string_merges(j):
        j["model"]["merges"] = [" ".join(m) for m in j["model"]["merges"]]
    write_hf(out, "gpt2", gpt2, lines, "<|endoftext|>", "<|endoftext|>", None, string_merges)

    def prefix_space(j):
        j["pre_tokenizer"]["add_prefix_space"] = True
    write_hf(out, "gpt2+prefix_space", gpt2, few, "<|endoftext|>", "<|endoftext|>", None,
             prefix_space)

    # Qwen2: NFC, Split(regex) then ByteLevel without its regex.
    qwen_pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    qwen = train_bpe(train, qwen_pre, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 3000)
    qwen.normalizer = normalizers.NFC()
    qwen.decoder = decoders.ByteLevel()
    qwen.post_processor = processors.ByteLevel(trim_offsets=False)
    qwen.add_tokens([AddedToken("<|tool|>", lstrip=True, rstrip=True),
                     AddedToken("LORD God", normalized=False)])
    write_hf(out, "qwen2", qwen, lines, None, "<|im_end|>", "<|endoftext|>")

    # Llama-3: the same layout, its own regex, ignore_merges, a bos added by TemplateProcessing.
    def llama3(j):
        j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": LLAMA3_REGEX}
        j["model"]["ignore_merges"] = True
        j["normalizer"] = None
        next_id = max(j["model"]["vocab"].values()) + 1
        for t in j["added_tokens"]:
            next_id = max(next_id, t["id"] + 1)
        j["added_tokens"].append({"id": next_id, "content": "<|begin_of_text|>", "single_word": False,
                                  "lstrip": False, "rstrip": False, "normalized": False,
                                  "special": True})
        j["post_processor"] = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
             "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [next_id],
                                                      "tokens": ["<|begin_of_text|>"]}}}]}
    write_hf(out, "qwen2+llama3", qwen, few, "<|begin_of_text|>", "<|endoftext|>", None, llama3)

    # Llama-2 / Mixtral: SentencePiece-style BPE with byte fallback, in the normalizer form.
    # Trained with a Metaspace pre-tokenizer (no merges across words, as sentencepiece trains),
    # then given the normalizer layout; the 256 byte tokens <0x00>..<0xFF> join the vocabulary.
    sp_special = ["<unk>", "<s>", "</s>"]
    llama = train_bpe(train, pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always"),
                      sp_special, 2500, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    llama.add_tokens([AddedToken("<|tool|>", normalized=False)])

    def llama2_layout(j):
        vocab = j["model"]["vocab"]
        next_id = max(vocab.values()) + 1
        for b in range(256):
            if f"<0x{b:02X}>" not in vocab:
                vocab[f"<0x{b:02X}>"] = next_id
                next_id += 1
        for t in j["added_tokens"]:  # after the model's vocabulary, as the library numbers them
            if t["content"] not in vocab:
                t["id"] = next_id
                next_id += 1
        j["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        j["pre_tokenizer"] = None
        j["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
        j["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]], "tokens": ["<s>"]}}}
    write_hf(out, "llama2", llama, lines, "<s>", "</s>", None, llama2_layout)

    # Mistral: normalizer null, Metaspace pre-tokenizer (prepend_scheme first, no split).
    def mistral_layout(j, scheme="first", split=False, metaspace_decoder=False):
        llama2_layout(j)
        j["normalizer"] = None
        j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                              "prepend_scheme": scheme, "split": split}
        if metaspace_decoder:
            j["decoder"] = {"type": "Sequence", "decoders": [
                {"type": "ByteFallback"},
                {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme,
                 "split": split}]}
    write_hf(out, "mistral", llama, lines, "<s>", "</s>", "<unk>", mistral_layout)
    write_hf(out, "mistral+split_always", llama, few, "<s>", "</s>", None,
             lambda j: mistral_layout(j, "always", True, True))
    write_hf(out, "mistral+never", llama, few, "<s>", "</s>", None,
             lambda j: mistral_layout(j, "never", False, True))

    # A sentencepiece .model (BPE, byte fallback), as Llama-2's tokenizer.model.
    d = save_dir(out, "spm")
    corpus_path = os.path.join(out, "spm_train.txt")
    with open(corpus_path, "w", encoding="utf-8") as f:
        f.write("\n".join(train[:12000]) + "\n")
    spm.SentencePieceTrainer.train(
        input=corpus_path, model_prefix=os.path.join(d, "tokenizer"), vocab_size=2000,
        model_type="bpe", byte_fallback=True, character_coverage=0.9995,
        user_defined_symbols=["<|tool|>"], num_threads=2, minloglevel=2)
    os.remove(os.path.join(d, "tokenizer.vocab"))
    sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
    plain = sp.encode(lines)
    rnd = random_id_sequences(sp.get_piece_size(), 11)
    write_json(os.path.join(out, "spm.ref.json"), {
        "ids": [[sp.bos_id()] + p for p in plain], "ids_plain": plain,
        "decoded": [sp.decode(p) for p in plain], "skipped": [sp.decode(p) for p in plain],
        "random_ids": rnd, "random_decoded": [sp.decode(r) for r in rnd],
        "vocab_size": sp.get_piece_size(), "bos": sp.bos_id(), "eos": sp.eos_id(), "pad": None})
    with open(stamp, "w") as f:
        f.write("make_tokenizers.py\n")
    print(f"make_tokenizers: {len(lines)} lines, {time.time() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
