"""The vendored convert_hf_to_gguf.py with the BPE pre-tokenizer named instead of recognized.

The converter names a byte-level BPE tokenizer's pre-tokenizer (tokenizer.ggml.pre, which tells
llama.cpp how to split text) by hashing how it encodes a fixed text, and refuses a tokenizer whose
hash it does not know. A synthetic tokenizer (benchmarks/qwen_style_tokenizer.py: a known
pre-tokenizer over another vocabulary) has no known hash; this names its pre-tokenizer and runs
the converter unchanged otherwise. Run with the converter's venv, the vendored llama.cpp folder
first on PYTHONPATH:

    convert-venv/bin/python convert_named_pre.py LLAMA_CPP_FOLDER PRE [convert_hf_to_gguf.py's arguments]
"""
import sys


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    source, pre = sys.argv[1], sys.argv[2]
    sys.path[0:0] = [source, f"{source}/gguf-py"]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    sys.argv = [f"{source}/convert_hf_to_gguf.py", *sys.argv[3:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
