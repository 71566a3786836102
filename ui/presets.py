"""Shared system prompts. Their text is identical for every user, so the KV blocks of a preset
are computed once and then served to everyone from the engine's prefix cache."""
from __future__ import annotations

CUSTOM = "Custom"
NONE = "None"

PRESETS: dict[str, str] = {
    "Helpful assistant": "You are a helpful, concise assistant. Answer clearly and say so when you are unsure.",
    "Code reviewer": ("You are a careful senior software engineer. Review code for bugs, clarity and "
                      "performance, and show corrected code in fenced code blocks."),
    "Teacher": ("You are a patient teacher. Explain ideas step by step with small examples, and check "
                "understanding with a short question at the end."),
    NONE: "",
}
DEFAULT = "Helpful assistant"
CHOICES = [*PRESETS, CUSTOM]


def system_prompt(preset: str | None, custom: str | None) -> str:
    """The system prompt a conversation uses: the preset's shared text, or the custom one."""
    if preset == CUSTOM:
        return (custom or "").strip()
    return PRESETS.get(preset or DEFAULT, PRESETS[DEFAULT])


def num_shared_messages(messages: list[dict]) -> int:
    """How many leading messages every user shares: 1 when the conversation opens with a preset's
    system prompt (public text whose KV blocks serve everyone), else 0."""
    first = messages[0] if messages else {}
    shared = first.get("role") == "system" and first.get("content") in PRESETS.values() and first.get("content")
    return 1 if shared else 0


def preset_for(prompt: str) -> tuple[str, str]:
    """The (preset, custom text) pair that shows a stored system prompt in the UI."""
    for name, text in PRESETS.items():
        if text == prompt:
            return name, ""
    return CUSTOM, prompt
