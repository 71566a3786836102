"""A tokenizer that splits text as Qwen2.5's does, made without Qwen's files: SmolLM2's byte-level BPE
(49,152 tokens and their merges, ChatML's special tokens among them, its ChatML template) under
Qwen2's pre-tokenizer (its split pattern, NFC), with Qwen2.5-Instruct's special tokens: no BOS,
eos `<|im_end|>`, pad `<|endoftext|>`. A Qwen2-shaped random model needs a tokenizer that
llama.cpp runs with its `qwen2` pre-tokenizer and transformers reads back from a GGUF file; the
vocabulary's size is the model's embedding rows, which the GGUF converter pads with `[PAD<id>]`
tokens up to the config's vocab_size, as Qwen2.5's own files are padded."""
from __future__ import annotations

# Qwen2's pre-tokenizer split pattern (its tokenizer.json; llama.cpp's `qwen2` pre-tokenizer).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# What llama.cpp calls this pre-tokenizer in a GGUF file (tokenizer.ggml.pre).
LLAMA_CPP_PRE = "qwen2"


def qwen_style_tokenizer(base):
    """`base` (a byte-level BPE transformers tokenizer with ChatML's tokens and template, e.g.
    SmolLM2's) with Qwen2's pre-tokenizer and special tokens: a PreTrainedTokenizerFast."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        if base.convert_tokens_to_ids(token) in (None, base.unk_token_id) and token != base.unk_token:
            raise ValueError(f"the base tokenizer has no {token!r}: a Qwen-style tokenizer needs ChatML's tokens")
    backend = Tokenizer.from_str(base.backend_tokenizer.to_str())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None, chat_template=base.chat_template,
                                   model_max_length=32768)
