"""Messages as the chatbot shows them: Markdown and code render, HTML shows as text, and each
reply carries its engine numbers underneath."""
from __future__ import annotations

import html
import re

# Fenced blocks (an unclosed one runs to the end, as while streaming) and inline code spans.
CODE = re.compile(r"(```.*?(?:```|\Z)|`[^`\n]+`)", re.DOTALL)


def as_text_markdown(text: str) -> str:
    """Escape HTML outside code, so `<script>` shows as written; code is already literal."""
    parts = CODE.split(text)
    return "".join(part if i % 2 else html.escape(part, quote=False) for i, part in enumerate(parts))


def metrics_line(message: dict) -> str:
    """'TTFT 0.12 s · 41.0 tok/s · 96 of 120 prompt tokens cached · by gpu1:8000', from a reply's
    metrics (the backend named when a remote one wrote it)."""
    bits = []
    if message.get("ttft_s") is not None:
        bits.append(f"TTFT {message['ttft_s']:.2f} s")
    if message.get("tokens_per_s") is not None:
        bits.append(f"{message['tokens_per_s']:.1f} tok/s")
    if message.get("prompt_tokens") is not None:
        if message.get("cached_tokens") is None:  # a server that does not report its cache hits
            bits.append(f"{message['prompt_tokens']} prompt tokens")
        else:
            bits.append(f"{message['cached_tokens']} of {message['prompt_tokens']} prompt tokens cached")
    if message.get("stopped"):
        bits.append("stopped")
    elif message.get("finish_reason") == "length":
        bits.append("cut at max tokens")
    if message.get("backend"):
        bits.append(f"by {message['backend']}")
    return " · ".join(bits)


def chat_message(message: dict) -> dict:
    """One stored (or in-progress) message as a chatbot message."""
    content = as_text_markdown(message["content"])
    if message["role"] == "assistant" and (line := metrics_line(message)):
        content += f"\n\n*{line}*"
    return {"role": message["role"], "content": content}


def error_message(text: str) -> dict:
    return {"role": "assistant", "content": f"⚠️ **Error:** {html.escape(text, quote=False)}"}


def chat_messages(messages: list[dict]) -> list[dict]:
    return [chat_message(m) for m in messages if m["role"] in ("user", "assistant")]
