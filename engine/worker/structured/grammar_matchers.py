"""Every constrained request's place in its grammar: which tokens it may sample next (a bitmask
over the vocabulary, applied to its logits before sampling) and the tokens it has taken.

A matcher follows its request's output tokens and is never rolled back: a request preempted by
swap or by recompute keeps its output tokens, so its matcher stays where it was. Samples forked
from a request (n > 1) fork its matcher before taking their first tokens. A JSON reply's matcher
comes with where its text stands (json_closing.py), so that it closes before its max_tokens."""
from __future__ import annotations

import json
import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch
import xgrammar as xgr

from engine.core.sampling_params import StructuredOutputsParams
from engine.worker.structured.grammar_compiler import GrammarCompiler
from engine.worker.structured.json_closing import OpenJson
from engine.worker.structured.schema_costs import SchemaCosts

log = logging.getLogger(__name__)


class GrammarMatchers:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self._pending: dict[str, Future] = {}
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._json: dict[str, OpenJson] = {}  # the JSON replies' open structure
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    # ---- requests in and out ------------------------------------------------------------
    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Start compiling the request's grammar (or take it from the cache)."""
        self._pending[request_id] = self.compiler.compile(params)
        if params.kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            self._json[request_id] = OpenJson(schema=SchemaCosts(schema) if isinstance(schema, dict) else None)
        elif params.kind == "json_object":
            self._json[request_id] = OpenJson()

    def poll(self) -> tuple[list[str], dict[str, str]]:
        """The requests whose grammar is ready since the last poll, and those whose grammar
        failed to compile (with why)."""
        ready, failed = [], {}
        for request_id, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            error = future.exception()
            if error is not None:
                failed[request_id] = str(error)
            else:
                self._matchers[request_id] = xgr.GrammarMatcher(future.result())
                ready.append(request_id)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Until a pending grammar is ready or `timeout` seconds passed (an engine with nothing
        else to run waits here rather than spin against the compiling thread)."""
        if self._pending:
            wait(list(self._pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._json.pop(request_id, None)

    # ---- one step -----------------------------------------------------------------------
    def constrains(self, request_id: str) -> bool:
        return request_id in self._matchers

    def mask_(self, logits: torch.Tensor, request_ids: list[str], rows: list[int], tokens_left: list[int]) -> None:
        """In place, -inf on every token the grammar does not allow next, for `request_ids`'
        rows of `logits` (fp32 `[rows, vocab]`). `tokens_left`: each request's max_tokens less
        its output so far; a JSON reply with just enough left to close is narrowed to closing."""
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        bitmask = self._bitmask[:logits.shape[0]]
        closing = self.compiler.closing
        for i, (request_id, row) in enumerate(zip(request_ids, rows)):
            self._matchers[request_id].fill_next_token_bitmask(bitmask, row)
            reply = self._json.get(request_id)
            if reply is not None and closing is not None:
                closing.narrow_(bitmask[row], reply, tokens_left[i])
        if bitmask.device != logits.device:  # the matchers fill it on the host; a GPU's logits mask there
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def accept(self, request_id: str, token: int) -> None:
        """The request took `token`."""
        if not self._matchers[request_id].accept_token(token):
            # Not after a mask: every token the mask lets through is one the matcher takes.
            log.error("request %s sampled token %d, which its grammar does not allow", request_id, token)
        reply = self._json.get(request_id)
        closing = self.compiler.closing
        if reply is not None and closing is not None and token < len(closing.token_bytes):
            reply.feed(closing.token_bytes[token])

    def fork(self, request_id: str, sample_id: str) -> None:
        """`sample_id` (a sample forked from the request) starts where the request is now."""
        self._matchers[sample_id] = self._matchers[request_id].fork()
        if request_id in self._json:
            self._json[sample_id] = self._json[request_id].copy()
