"""Which grammar library constrains our decoding: xgrammar against llguidance, on this CPU.

For each library and vocabulary (SmolLM2's 49,152 tokens, and the same tokenizer grown to 128,000
with tokens no merge reaches, as a Llama-3-sized vocabulary's mask work):
- compile: a typical JSON schema (nested object, enum, array with maxItems, a pattern, required,
  additionalProperties false) to a grammar the matcher runs, cold (no cache), median of 5;
- mask: the per-token cost of the next-token bitmask while a matcher walks a valid reply of that
  schema token by token (p50 and p99 over the reply's tokens), and of accepting each token;
- the GIL: how far a Python thread gets while another thread compiles (100%: compiling never
  holds the GIL; the engine loop compiles grammars on a thread beside its steps; noise for a
  compile of a millisecond or less, such as llguidance's lazy one);
- install size of the package and what it brings.

xgrammar is the project's; llguidance is measured where it is installed.

    .venv/bin/python benchmarks/grammar_libraries.py
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "role": "editor",
            "tags": ["maths", "engines", "poetry"], "address": {"city": "London", "zip": "W1"}, "active": True}


def grown_tokenizer(base, size: int):
    """`base` (a fast byte-level BPE tokenizer) with tokens appended up to `size`: random strings of
    its byte alphabet that no merge produces. Their masks cost what real tokens' cost."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(base.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    alphabet = sorted({ch for token in list(vocab)[:2000] for ch in token})
    rng = random.Random(0)
    next_id = max(vocab.values()) + 1
    while next_id < size:
        token = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9)))
        if token not in vocab:
            vocab[token] = next_id
            next_id += 1
    grown = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                    eos_token=base.eos_token, bos_token=base.bos_token)
    return grown


class XGrammar:
    name = "xgrammar"
    packages = ("xgrammar", "tvm_ffi")

    @staticmethod
    def preload() -> None:
        import xgrammar  # noqa: F401

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=[tokenizer.eos_token_id])
        self.vocab_size = vocab_size

    def compile(self):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)

    def walk(self, compiled, tokens: list[int]) -> tuple[list[float], list[float]]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        return timed_walk(tokens, lambda: matcher.fill_next_token_bitmask(bitmask, 0), matcher.accept_token)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)


class LLGuidance:
    name = "llguidance"
    packages = ("llguidance",)

    @staticmethod
    def preload() -> None:
        import llguidance.hf  # noqa: F401
        import llguidance.torch  # noqa: F401

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # llguidance builds its parser lazily
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def walk(self, grammar, tokens: list[int]) -> tuple[list[float], list[float]]:
        import llguidance.torch as llt
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        bitmask = llt.allocate_token_bitmask(1, self.vocab_size)
        return timed_walk(tokens, lambda: llt.fill_next_token_bitmask(matcher, bitmask, 0), matcher.consume_token)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        import llguidance.torch as llt
        llt.apply_token_bitmask_inplace(logits, bitmask)

    def bitmask(self, rows: int) -> torch.Tensor:
        import llguidance.torch as llt
        return llt.allocate_token_bitmask(rows, self.vocab_size)


def timed_walk(tokens: list[int], fill, accept) -> tuple[list[float], list[float]]:
    """Seconds of each token's mask (`fill()`) and of taking it (`accept(token)`, which must take it)."""
    fills, accepts = [], []
    for token in tokens:
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        ok = accept(token)
        fills.append(t1 - t0)
        accepts.append(time.perf_counter() - t1)
        assert ok, f"the matcher refused token {token}"
    return fills, accepts


def gil_share(work) -> float:
    """How much a pure-Python counting thread gets done while `work` runs on another thread, as a
    share of what it gets done beside a thread that only sleeps for as long."""
    def rate_beside(job) -> tuple[float, float]:
        done = threading.Event()

        def run():
            job()
            done.set()
        thread = threading.Thread(target=run)
        started = time.perf_counter()
        thread.start()
        n = 0
        while not done.is_set():
            n += 1
        elapsed = time.perf_counter() - started
        thread.join()
        return n / elapsed, elapsed
    rate, elapsed = rate_beside(work)
    alone, _ = rate_beside(lambda: time.sleep(max(elapsed, 0.05)))
    return rate / alone


def install_mb(packages: tuple[str, ...]) -> float:
    import importlib.util
    total = 0
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for folder in spec.submodule_search_locations:
            total += sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    return total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", default="49152,128000", help="vocabulary sizes (the first is SmolLM2's own)")
    args = parser.parse_args()
    from engine.worker.loading.model_loader import load_tokenizer
    base = load_tokenizer(None)
    reply = json.dumps(INSTANCE)
    rows = []
    for size in [int(v) for v in args.vocab.split(",")]:
        tokenizer = base if size <= len(base) else grown_tokenizer(base, size)
        tokens = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        for library in (XGrammar, LLGuidance):
            try:
                library.preload()
            except ImportError:  # llguidance is not a dependency of the project
                print(f"{library.name} is not installed: `.venv/bin/pip install -c constraints.txt {library.name}`")
                continue
            t0 = time.perf_counter()
            lib = library(tokenizer, size)
            setup = time.perf_counter() - t0
            compiles = []
            for _ in range(5):
                t0 = time.perf_counter()
                compiled = lib.compile()
                compiles.append(time.perf_counter() - t0)
            lib.walk(compiled, tokens)  # warm
            fills, accepts = lib.walk(compiled, tokens)
            logits = torch.randn(32, size)
            bitmask = lib.bitmask(32)
            bitmask.fill_(-1)
            lib.apply(logits, bitmask)  # a first call may build a kernel
            t0 = time.perf_counter()
            for _ in range(20):
                lib.apply(logits, bitmask)
            apply_ms = (time.perf_counter() - t0) / 20 * 1e3
            share = gil_share(lib.compile)
            fills.sort()
            rows.append({
                "library": lib.name, "vocab": size, "tokenizer_setup_ms": round(setup * 1e3, 1),
                "compile_ms": round(statistics.median(compiles) * 1e3, 2),
                "mask_us_p50": round(fills[len(fills) // 2] * 1e6, 1),
                "mask_us_p99": round(fills[min(len(fills) - 1, int(len(fills) * 0.99))] * 1e6, 1),
                "mask_us_mean": round(statistics.mean(fills) * 1e6, 1),
                "accept_us_mean": round(statistics.mean(accepts) * 1e6, 1),
                "apply_32_rows_ms": round(apply_ms, 3),
                "python_thread_during_compile": round(share, 2),
                "install_mb": round(install_mb(lib.packages), 1), "reply_tokens": len(tokens)})
    print(f"Grammar libraries on {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'library':<11} {'vocab':>7} {'tok. setup':>10} {'compile':>9} {'mask p50':>9} {'mask p99':>9} "
          f"{'mask mean':>9} {'accept':>7} {'apply 32':>9} {'py thread':>9} {'install':>8}")
    for r in rows:
        print(f"{r['library']:<11} {r['vocab']:>7} {r['tokenizer_setup_ms']:>8.0f}ms {r['compile_ms']:>7.1f}ms "
              f"{r['mask_us_p50']:>7.0f}us {r['mask_us_p99']:>7.0f}us {r['mask_us_mean']:>7.0f}us "
              f"{r['accept_us_mean']:>5.0f}us {r['apply_32_rows_ms']:>7.3f}ms {r['python_thread_during_compile']:>9.0%} "
              f"{r['install_mb']:>6.1f}MB")
    print(json.dumps({"benchmark": "grammar_libraries", "cpu": cpu_model(), "rows": rows}))


if __name__ == "__main__":
    main()
