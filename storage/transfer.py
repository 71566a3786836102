"""A conversation out of the store and back in: JSON (the OpenAI messages shape, each reply with
its engine numbers) and Markdown (to read or paste elsewhere).

What is exported is the branch shown, with the system prompt as the first message; importing
the JSON gives a new conversation of the importing user with exactly those messages and
numbers, so exporting it again gives the same document. Earlier versions (regenerated or edited
messages) stay behind: a file is one conversation as it reads.
"""
from __future__ import annotations

import json
from typing import Any

from storage import validation
from storage.store import Store

FORMAT = "pagedchat.conversation/1"
MAX_IMPORT_MESSAGES = 10_000
MAX_TITLE_CHARS = 200


class NotAConversation(ValueError):
    """A file that is not a conversation this app exported (or one shaped like it); the message
    says what is wrong."""


def conversation_document(store: Store, user_id: str, conversation_id: int) -> dict[str, Any]:
    """The conversation as a JSON-ready dict: format, title and the messages."""
    conversation = store.conversation(user_id, conversation_id)
    messages: list[dict[str, Any]] = []
    if conversation["system_prompt"].strip():
        messages.append({"role": "system", "content": conversation["system_prompt"]})
    for row in store.messages(user_id, conversation_id):
        message: dict[str, Any] = {"role": row["role"], "content": row["content"]}
        if row["role"] == "assistant":
            message["metrics"] = {name: row[name] for name in validation.METRICS if row.get(name) is not None}
        messages.append(message)
    return {"format": FORMAT, "title": conversation["title"], "messages": messages}


def conversation_json(store: Store, user_id: str, conversation_id: int) -> str:
    return json.dumps(conversation_document(store, user_id, conversation_id), ensure_ascii=False, indent=2)


def conversation_markdown(store: Store, user_id: str, conversation_id: int) -> str:
    """A readable transcript: the title, then each message under its speaker (the system prompt
    as a quote), each reply's numbers in a line of its own."""
    document = conversation_document(store, user_id, conversation_id)
    lines = [f"# {document['title']}", ""]
    names = {"system": "System prompt", "user": "You", "assistant": "Assistant"}
    for message in document["messages"]:
        lines += [f"## {names[message['role']]}", ""]
        if message["role"] == "system":
            lines += ["> " + line for line in message["content"].splitlines()] + [""]
            continue
        lines += [message["content"], ""]
        if numbers := message.get("metrics"):
            lines += ["*" + ", ".join(f"{name} {value}" for name, value in numbers.items()) + "*", ""]
    return "\n".join(lines)


def import_conversation(store: Store, user_id: str, text: str | bytes) -> dict:
    """A new conversation of `user_id` from an exported JSON document; returns its row. Nothing
    is stored unless the whole document is valid."""
    try:
        document = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NotAConversation(f"The file is not JSON ({error}).") from None
    if not isinstance(document, dict) or not isinstance(document.get("messages"), list):
        raise NotAConversation("The file has no list of messages: export a chat as JSON to see the shape.")
    if document.get("format", FORMAT) != FORMAT:
        raise NotAConversation(f"The file's format is {document['format']!r}; this app reads {FORMAT!r}.")
    messages = document["messages"]
    if not messages or len(messages) > MAX_IMPORT_MESSAGES:
        raise NotAConversation(f"A chat has 1 to {MAX_IMPORT_MESSAGES:,} messages; this file has {len(messages):,}.")
    system_prompt = ""
    if isinstance(messages[0], dict) and messages[0].get("role") == "system":
        system_prompt = validation.text(messages[0].get("content"), "system prompt")
        messages = messages[1:]
    rows = []
    for number, message in enumerate(messages, start=1):
        try:
            if not isinstance(message, dict):
                raise ValueError("it is not an object with a role and content")
            role = message.get("role")
            if role not in ("user", "assistant"):
                raise ValueError(f"its role is {role!r}; after the system prompt only user and assistant")
            metrics = message.get("metrics") or {}
            if not isinstance(metrics, dict) or (metrics and role != "assistant"):
                raise ValueError("only a reply carries metrics, as an object")
            rows.append((role, validation.content(message.get("content")), validation.metrics(metrics)))
        except ValueError as error:
            raise NotAConversation(f"Message {number} cannot be imported: {error}.") from None
    title = document.get("title") if isinstance(document.get("title"), str) and document["title"].strip() \
        else rows[0][1]
    title = title.strip()[:MAX_TITLE_CHARS]
    with store.transaction():
        conversation = store.create_conversation(user_id, title=title, system_prompt=system_prompt)
        for role, content, metrics in rows:
            store.add_message(user_id, conversation["id"], role, content, **metrics)
    return store.conversation(user_id, conversation["id"])
