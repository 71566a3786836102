"""Grammars compiled against the model's vocabulary, on a thread of the compiler's own.

Compiling a JSON schema for a 49,152-token vocabulary takes ~20 ms, a 128,000-token one ~50 ms
(benchmarks/grammar_libraries.py), and xgrammar releases the GIL while it compiles: a request
waits for its grammar, the steps of the others go on. Compiled grammars are kept by their
constraint's text (StructuredOutputsParams.key), so a schema an application sends with every
request compiles once."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from engine.core.sampling_params import StructuredOutputsParams
from engine.worker.structured.grammar import grammar_of
from engine.worker.structured.json_closing import ClosingMasks

CACHED_GRAMMARS = 256
# Compiled grammars keep a token mask per state: 35 KiB for a two-property schema, 6.4 MiB for 120
# properties with patterns (at 49,152 tokens); the cache keeps at most this many bytes of them.
CACHED_BYTES = 128 * 2**20


class GrammarCompiler:
    def __init__(self, tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: list[int]) -> None:
        """`tokenizer`: returns the model's transformers tokenizer, called once, on the compiler's
        thread, with the first grammar (an engine core that serves none never loads it).
        `vocab_size`: the model's logits width (it may pad the tokenizer's vocabulary)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: xgr.GrammarCompiler | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compiler")
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        # Made with the vocabulary, before the first grammar is handed out (json_closing.py).
        self.closing: ClosingMasks | None = None

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar (xgrammar's CompiledGrammar), now or later. Its exception, for a
        constraint that does not compile, is InvalidStructuredOutputsError."""
        key = params.key()
        future = self._compiled.get(key)
        if future is None:
            future = self._compiled[key] = self._thread.submit(self._compile, params)
            self._evict()
        else:
            self._compiled.move_to_end(key)
        return future

    def _evict(self) -> None:
        """The least recently asked for first, while the cache holds too many or too many bytes
        (requests that hold a grammar keep it whatever the cache does)."""
        def size(future: Future) -> int:
            done = future.done() and future.exception() is None
            return future.result().memory_size_bytes if done else 0
        total = sum(size(future) for future in self._compiled.values())
        while len(self._compiled) > 1 and (len(self._compiled) > CACHED_GRAMMARS or total > CACHED_BYTES):
            _, oldest = self._compiled.popitem(last=False)
            total -= size(oldest)

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer(), vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop_token_ids)
            self.closing = ClosingMasks(info.decoded_vocab, info.stop_token_ids, self._vocab_size)
            # One thread: the engine's compute threads have the other cores.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(grammar_of(params))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
