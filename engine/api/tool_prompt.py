"""A chat with tools as the model's prompt.

A chat template that takes tools (its text mentions `tools`: Qwen2.5's, Llama 3.1's, Hermes')
renders them itself, with the conversation's calls and their results: the prompt is that text.

One that does not (SmolLM2's plain ChatML) gets them written into the messages the way Qwen2.5's
template writes them (the Hermes format, which small instruction-tuned models follow best):

- the system message (one is added first if the chat has none) ends with a `# Tools` section:
  each function's definition as one JSON line inside `<tools></tools>`, and the instruction to
  answer with `<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>`;
- an assistant message's `tool_calls` follow its text, each as such a block;
- `role: "tool"` messages become a user turn (consecutive ones, the same turn) of
  `<tool_response>\\n...\\n</tool_response>` blocks.

These stay messages of {"role", "content"}, so the engine renders them with the template as any
chat, and a preset system prompt shared by many users stays shared in the prefix cache (with the
same tools, its tools section is the same text too)."""
from __future__ import annotations

import json

TOOLS_SECTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default, or the one for tools
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    """Whether a chat has tools or a call or a tool result in it."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None,
                num_shared_messages: int = 0) -> tuple[str | list[dict], int]:
    """The prompt for a chat with tools (or calls, or results), and how many of its leading
    messages are shared: the text of a chat template that takes tools (a Jinja render, no
    tokenizing; shared by none), or the messages with the tools written in."""
    if template_takes_tools(tokenizer):
        return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                             tokenize=False), 0
    written, added = hermes_messages(messages, tools)
    return written, num_shared_messages + added if num_shared_messages else 0


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], int]:
    """The chat as {"role", "content"} messages with the tools, calls and results written in
    (the module's docstring), and how many messages were added in front (0 or 1)."""
    out: list[dict] = []
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if i > 0 and messages[i - 1]["role"] == "tool":
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            continue
        if role == "assistant" and message.get("tool_calls"):
            blocks = [call_block(call["function"]["name"], call["function"]["arguments"])
                      for call in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": role, "content": content})
    if not tools:
        return out, 0
    section = TOOLS_SECTION.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section}
        return out, 0
    return [{"role": "system", "content": section}, *out], 1


def call_block(name: str, arguments: dict) -> str:
    """A call as the model writes one (Qwen2.5's template: name first, arguments as JSON)."""
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ' \
           f'{json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'
