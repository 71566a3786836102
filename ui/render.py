"""Messages as the chatbot shows them: Markdown and code render, HTML shows as text, and each
reply carries its engine numbers underneath. A message with other versions (regenerated, or
edited) carries a `‹ 2/3 ›` whose arrows are links the page's script turns into `show_version`
calls (ui/page_script.py). A reply also carries its Markdown source, base64 in an empty span,
for the copy button: what the chatbot holds is escaped text plus this footer, and the script
copies the source instead."""
from __future__ import annotations

import base64
import html
import re

# Fenced blocks (an unclosed one runs to the end, as while streaming) and inline code spans.
CODE = re.compile(r"(```.*?(?:```|\Z)|`[^`\n]+`)", re.DOTALL)


VERSION_LINK = "#pc-version-"  # an arrow's href: this prefix, then the message id to show
# The footer is one line, the last; a reply's source span is its last element (the page's script
# trusts only a `data-source` there, since a reply's own text may contain one).
FOOTER = re.compile(r'\n\n<div class="pc-meta">[^\n]*</div>\Z')


def as_text_markdown(text: str) -> str:
    """Escape HTML outside code, so `<script>` shows as written; code is already literal."""
    parts = CODE.split(text)
    return "".join(part if i % 2 else html.escape(part, quote=False) for i, part in enumerate(parts))


def source_of(shown: str) -> str:
    """The text a user typed, from a message as the chatbot holds it (Gradio's edit box starts
    from that): the footer dropped and `as_text_markdown` undone."""
    parts = CODE.split(FOOTER.sub("", shown))
    return "".join(part if i % 2 else html.unescape(part) for i, part in enumerate(parts))


def version_links(message: dict) -> str:
    """`‹ 2/3 ›` for a message with other versions (arrows at either end are plain text), else ""."""
    if (message.get("versions") or 1) < 2:
        return ""

    def arrow(symbol: str, target: int | None, what: str) -> str:
        if target is None:
            return f'<span class="pc-off">{symbol}</span>'
        return f'<a href="{VERSION_LINK}{int(target)}" title="{what} version">{symbol}</a>'

    return (f'{arrow("‹", message.get("previous_version_id"), "Previous")} '
            f'{int(message["version"])}/{int(message["versions"])} '
            f'{arrow("›", message.get("next_version_id"), "Next")}')


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
    if message.get("left_out"):
        bits.append(f"written without the {message['left_out']} oldest messages (context full)")
    if message.get("stopped"):
        bits.append("stopped")
    elif message.get("finish_reason") == "length":
        bits.append("cut at max tokens")
    if message.get("backend"):
        bits.append(f"by {message['backend']}")
    return " · ".join(bits)


def chat_message(message: dict) -> dict:
    """One stored (or in-progress) message as a chatbot message: the text, then a footer with
    its versions and (a reply's) numbers and source."""
    shown = [links] if (links := version_links(message)) else []
    source = ""
    if message["role"] == "assistant":
        if line := metrics_line(message):
            shown.append(f"<em>{html.escape(line)}</em>")
        encoded = base64.b64encode(message["content"].encode()).decode()
        source = f'<span class="pc-source" data-source="{encoded}"></span>'
    content = as_text_markdown(message["content"])
    if shown or source:
        content += '\n\n<div class="pc-meta">' + " · ".join(shown) + source + "</div>"
    return {"role": message["role"], "content": content}


def error_message(text: str) -> dict:
    return {"role": "assistant", "content": f"⚠️ **Error:** {html.escape(text, quote=False)}"}


def chat_messages(messages: list[dict]) -> list[dict]:
    return [chat_message(m) for m in messages if m["role"] in ("user", "assistant")]
