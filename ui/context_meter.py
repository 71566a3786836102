"""The line above the message box: the model, and how full this chat's context is.

The numbers are the engine's own, from the chat's latest reply: the prompt it was given plus
the tokens it wrote are what the next turn starts from, and of that prompt, how many tokens the
prefix cache served. The limit is the backend's `max_model_len`. From WARN_SHARE on, the line
warns and the page offers its two ways on: continue in a new chat that carries a summary, or
let this chat leave out its oldest turns when the next one would not fit.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

WARN_SHARE = 0.8


@dataclass(frozen=True)
class ContextUse:
    model: str | None
    tokens: int          # the latest reply's prompt plus its output: 0 before the first reply
    cached: int          # of its prompt, tokens the prefix cache served
    limit: int | None    # max_model_len; None when the backend does not say

    @property
    def share(self) -> float | None:
        return self.tokens / self.limit if self.limit else None

    @property
    def near_limit(self) -> bool:
        return self.share is not None and self.share >= WARN_SHARE


def context_use(rows: list[dict], model: str | None, limit: int | None) -> ContextUse:
    """From the chat shown (the store's rows): its latest reply's numbers."""
    reply = next((m for m in reversed(rows) if m["role"] == "assistant" and m.get("prompt_tokens")), None)
    if reply is None:
        return ContextUse(model, 0, 0, limit)
    return ContextUse(model, reply["prompt_tokens"] + (reply.get("completion_tokens") or 0),
                      reply.get("cached_tokens") or 0, limit)


def meter_html(use: ContextUse) -> str:
    """The line as HTML; every number in a `data-` attribute too, for tests and scripts."""
    model = html.escape(use.model or "no model reachable")
    if use.limit:
        share = use.share or 0.0
        fill = f'<span class="pc-meter-bar"><span style="width:{min(100.0, 100 * share):.1f}%"></span></span>'
        words = f"{use.tokens:,} of {use.limit:,} tokens ({100 * share:.0f}%) · {use.cached:,} from the prefix cache"
    else:
        fill, words = "", f"{use.tokens:,} tokens · {use.cached:,} from the prefix cache"
    warning = ""
    if use.near_limit:
        warning = (' <strong class="pc-meter-warn">Nearly full: continue in a new chat with a summary, or let '
                   "this chat leave out its oldest turns (below).</strong>")
    return (f'<div class="pc-meter{" pc-near" if use.near_limit else ""}" data-tokens="{use.tokens}" '
            f'data-cached="{use.cached}" data-limit="{use.limit or 0}"><span class="pc-model">{model}</span> · '
            f"{fill} {words}{warning}</div>")
