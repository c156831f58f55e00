#!/usr/bin/env python3
"""llama.cpp's own converter (convert_hf_to_gguf.py) run on the comparison's model, with one
change: a BPE pre-tokenizer it does not recognise is written as "gpt-2" instead of refused.

    python benchmarks/compare/llamacpp_convert.py LLAMA_CPP_DIR -- MODEL_DIR --outtype f32 --outfile m.gguf

The converter names a tokenizer's pre-tokenizer by the hash of the ids it gives a fixed text
(TextModel.get_vocab_base_pre), a list of released models' tokenizers. The comparison's model has
a tokenizer trained for it (benchmarks/compare/llamacpp_model.py: GPT-2's byte-level
pre-tokenizer, its own merges), whose hash no list holds; GPT-2's pre-tokenizer is what it uses.
The tokenizer only turns text into ids: the weights and the graph the converter writes are its
own, unchanged. Everything else is the converter's main() with the arguments after "--".
"""
import sys
from pathlib import Path


def main():
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit(__doc__.split("\n\n")[1])
    src = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(src))
    sys.path.insert(1, str(src / "gguf-py"))
    sys.argv = [str(src / "convert_hf_to_gguf.py")] + sys.argv[3:]
    import convert_hf_to_gguf as conv
    from conversion.base import TextModel

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print("llamacpp_convert: pre-tokenizer not in the converter's list: written as gpt-2",
                  file=sys.stderr)
            return "gpt-2"

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    conv.main()


if __name__ == "__main__":
    main()
