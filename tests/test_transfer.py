"""Export a conversation (JSON and Markdown) and import the JSON back, against a real store."""
from __future__ import annotations

import json

import pytest

from storage import NotFound, Store
from storage.transfer import FORMAT, NotAConversation, conversation_json, conversation_markdown, import_conversation


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "chat.db") as store:
        yield store


def chat_with_versions(store: Store) -> int:
    chat = store.create_conversation("ada", title="Paged <attention>", system_prompt="Be brief.\nAnd exact.")
    store.add_message("ada", chat["id"], "user", "How big is a block?")
    store.add_message("ada", chat["id"], "assistant", "Sixteen tokens.", prompt_tokens=30, cached_tokens=16,
                      completion_tokens=4, ttft_s=0.12, tokens_per_s=41.5, finish_reason="stop")
    store.replace_last_assistant("ada", chat["id"], "**16** tokens, `block_size`.", prompt_tokens=30,
                                 cached_tokens=30, completion_tokens=7, ttft_s=0.05, tokens_per_s=40.0,
                                 finish_reason="length", backend="gpu1:8000")
    store.add_message("ada", chat["id"], "user", "Thanks — ünïcode & <b>")
    store.add_message("ada", chat["id"], "assistant", "You're welcome", completion_tokens=3, stopped=True)
    return chat["id"]


def test_export_is_the_branch_shown_in_the_openai_shape_with_metrics(store):
    chat_id = chat_with_versions(store)
    document = json.loads(conversation_json(store, "ada", chat_id))
    assert document["format"] == FORMAT and document["title"] == "Paged <attention>"
    assert [(m["role"], m["content"]) for m in document["messages"]] == [
        ("system", "Be brief.\nAnd exact."), ("user", "How big is a block?"),
        ("assistant", "**16** tokens, `block_size`."), ("user", "Thanks — ünïcode & <b>"),
        ("assistant", "You're welcome")]
    assert document["messages"][2]["metrics"] == {
        "prompt_tokens": 30, "cached_tokens": 30, "completion_tokens": 7, "ttft_s": 0.05, "tokens_per_s": 40.0,
        "finish_reason": "length", "stopped": False, "backend": "gpu1:8000"}
    assert document["messages"][4]["metrics"]["stopped"] is True
    assert "metrics" not in document["messages"][1]


def test_import_round_trips_exactly_and_belongs_to_the_importer(store):
    exported = conversation_json(store, "ada", chat_with_versions(store))
    imported = import_conversation(store, "bob", exported)
    assert imported["user_id"] == "bob" and imported["title"] == "Paged <attention>"
    assert conversation_json(store, "bob", imported["id"]) == exported
    with pytest.raises(NotFound):
        store.messages("ada", imported["id"])


def test_markdown_reads_as_a_transcript(store):
    text = conversation_markdown(store, "ada", chat_with_versions(store))
    assert text.startswith("# Paged <attention>\n")
    assert "## System prompt\n\n> Be brief.\n> And exact." in text
    assert "## You\n\nHow big is a block?" in text and "## Assistant\n\n**16** tokens, `block_size`." in text
    assert "*prompt_tokens 30, cached_tokens 30, completion_tokens 7" in text
    assert "Sixteen tokens." not in text  # the earlier version stays behind


@pytest.mark.parametrize("text, error", [
    ("not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    ("[]", "no list of messages"),
    ('{"messages": []}', "1 to 10,000 messages"),
    ('{"format": "other/2", "messages": [{"role": "user", "content": "hi"}]}', "format is 'other/2'"),
    ('{"messages": [{"role": "tool", "content": "hi"}]}', "Message 1 .*role is 'tool'"),
    ('{"messages": [{"role": "user", "content": "  "}]}', "Message 1 .*non-empty text"),
    ('{"messages": [{"role": "user", "content": "hi", "metrics": {"ttft_s": 1}}]}', "only a reply carries metrics"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", '
     '"metrics": {"tokens": 3}}]}', "Message 2 .*unknown message metrics"),
    ('{"messages": [{"role": "user", "content": "a"}, "b"]}', "Message 2 .*not an object"),
])
def test_a_bad_file_is_refused_with_what_is_wrong_and_nothing_is_stored(store, text, error):
    with pytest.raises(NotAConversation, match=error):
        import_conversation(store, "ada", text)
    assert store.conversations("ada") == []


def test_an_untitled_file_is_titled_from_its_first_message_and_delete_all_keeps_others(store):
    imported = import_conversation(store, "ada", '{"messages": [{"role": "user", "content": "Hello there"}]}')
    assert imported["title"] == "Hello there" and imported["system_prompt"] == ""
    chat_with_versions(store)
    import_conversation(store, "bob", '{"messages": [{"role": "user", "content": "Mine"}]}')
    assert store.delete_conversations("ada") == 2
    assert store.conversations("ada") == [] and [c["title"] for c in store.conversations("bob")] == ["Mine"]
