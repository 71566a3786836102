"""The storage layer: users, conversations and messages in SQLite, scoped to a user."""
from __future__ import annotations

import sqlite3
import threading

import pytest
from sqlite_utils import Database, Migrations

import storage
from storage import NotFound, Store


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "chat.db") as s:
        yield s


@pytest.fixture
def chat(store):
    """Ada's conversation with one exchange; Bob exists with a conversation of his own."""
    c = store.create_conversation("ada", title="Paged attention", system_prompt="Be brief.")
    store.add_message("ada", c["id"], "user", "How are KV blocks allocated?")
    store.add_message("ada", c["id"], "assistant", "From a free pool, one block at a time.",
                      prompt_tokens=12, cached_tokens=8, completion_tokens=9, ttft_s=0.05,
                      tokens_per_s=42.0, finish_reason="stop")
    store.create_conversation("bob", title="Bob's chat")
    return c


def count(store, table):
    return store.db.execute(f"select count(*) from {table}").fetchone()[0]


# --- create, read, update, delete ---------------------------------------------------------

def test_a_new_conversation_reads_back_as_created(store):
    c = store.create_conversation("ada", title="  First  ", system_prompt="Be kind.")
    assert store.conversation("ada", c["id"]) == c
    assert (c["user_id"], c["title"], c["system_prompt"]) == ("ada", "First", "Be kind.")
    assert c["created"] == c["updated"]
    assert store.db["users"].get("ada")["id"] == "ada"  # created on first sight
    assert store.messages("ada", c["id"]) == []


def test_rename_and_system_prompt_change_the_row_and_bump_updated(store, chat):
    renamed = store.rename("ada", chat["id"], "KV blocks")
    assert renamed["title"] == "KV blocks" and renamed["updated"] > chat["updated"]
    assert store.set_system_prompt("ada", chat["id"], "Be thorough.")["system_prompt"] == "Be thorough."
    assert store.conversation("ada", chat["id"])["title"] == "KV blocks"


def test_deleting_a_conversation_removes_it_and_its_messages(store, chat):
    store.delete_conversation("ada", chat["id"])
    with pytest.raises(NotFound, match=f"conversation {chat['id']} not found"):
        store.conversation("ada", chat["id"])
    assert store.conversations("ada") == []
    assert store.db.execute("select count(*) from messages where conversation_id = ?",
                            [chat["id"]]).fetchone()[0] == 0


def test_messages_come_back_in_order_with_their_metrics(store, chat):
    user, reply = store.messages("ada", chat["id"])
    assert (user["role"], reply["role"]) == ("user", "assistant")
    assert user["id"] < reply["id"]
    assert (reply["prompt_tokens"], reply["cached_tokens"], reply["completion_tokens"]) == (12, 8, 9)
    assert (reply["ttft_s"], reply["tokens_per_s"], reply["finish_reason"]) == (0.05, 42.0, "stop")
    assert reply["stopped"] is False


def test_a_stopped_reply_is_stored_as_the_user_saw_it(store, chat):
    reply = store.add_message("ada", chat["id"], "assistant", "Blocks are handed out as the seq",
                              completion_tokens=7, stopped=True)
    assert reply["stopped"] is True and reply["finish_reason"] == "abort"
    assert store.messages("ada", chat["id"])[-1]["content"] == "Blocks are handed out as the seq"
    with pytest.raises(ValueError, match="abort"):
        store.add_message("ada", chat["id"], "assistant", "x", stopped=True, finish_reason="stop")


def test_conversations_are_listed_most_recently_updated_first(store):
    a = store.create_conversation("ada", title="a")
    b = store.create_conversation("ada", title="b")
    c = store.create_conversation("ada", title="c")
    assert [x["title"] for x in store.conversations("ada")] == ["c", "b", "a"]
    store.add_message("ada", a["id"], "user", "back to a")
    assert [x["title"] for x in store.conversations("ada")] == ["a", "c", "b"]
    store.rename("ada", b["id"], "b2")
    assert [x["title"] for x in store.conversations("ada", limit=2)] == ["b2", "a"]
    assert c["id"] > b["id"] > a["id"]


def branch(store, chat_id, user="ada"):
    return [(m["content"], m["version"], m["versions"]) for m in store.messages(user, chat_id)]


def test_regenerating_shows_a_new_version_of_the_last_reply_and_keeps_the_old(store, chat):
    new = store.replace_last_assistant("ada", chat["id"], "Blocks come from a pool.", finish_reason="stop")
    assert branch(store, chat["id"]) == [("How are KV blocks allocated?", 1, 1), ("Blocks come from a pool.", 2, 2)]
    assert new["finish_reason"] == "stop"
    first = store.messages("ada", chat["id"])[0]
    old = [m for m in store.db["messages"].rows_where("content = ?", ["From a free pool, one block at a time."])]
    assert store.show_version("ada", chat["id"], old[0]["id"])[-1]["content"] == "From a free pool, one block at a time."
    assert branch(store, chat["id"])[-1] == ("From a free pool, one block at a time.", 1, 2)
    assert store.messages("ada", chat["id"])[0] == first
    store.add_message("ada", chat["id"], "user", "And freed?")
    with pytest.raises(NotFound, match="assistant reply"):
        store.replace_last_assistant("ada", chat["id"], "no reply to replace")


def test_each_message_names_its_neighbouring_versions(store, chat):
    first = store.messages("ada", chat["id"])[1]
    second = store.replace_last_assistant("ada", chat["id"], "Second.")
    third = store.replace_last_assistant("ada", chat["id"], "Third.")
    def neighbours():
        return [(m["previous_version_id"], m["next_version_id"]) for m in store.messages("ada", chat["id"])]
    assert neighbours() == [(None, None), (second["id"], None)]
    store.show_version("ada", chat["id"], second["id"])
    assert neighbours() == [(None, None), (first["id"], third["id"])]
    store.show_version("ada", chat["id"], first["id"])
    assert neighbours() == [(None, None), (None, second["id"])]


def test_editing_any_user_message_forks_there_and_keeps_what_followed_the_old_one(store, chat):
    store.add_message("ada", chat["id"], "user", "And freed?")
    store.add_message("ada", chat["id"], "assistant", "When the request ends.")
    first = store.messages("ada", chat["id"])[0]
    edited = store.edit_message("ada", chat["id"], first["id"], "How big is a KV block?")
    assert edited["role"] == "user"
    assert branch(store, chat["id"]) == [("How big is a KV block?", 2, 2)]  # to be answered
    store.add_message("ada", chat["id"], "assistant", "Sixteen tokens.")
    assert branch(store, chat["id"]) == [("How big is a KV block?", 2, 2), ("Sixteen tokens.", 1, 1)]
    # Back to the first version: the conversation as it went on from there, all four messages.
    assert [m["content"] for m in store.show_version("ada", chat["id"], first["id"])] == [
        "How are KV blocks allocated?", "From a free pool, one block at a time.", "And freed?",
        "When the request ends."]
    assert branch(store, chat["id"])[0] == ("How are KV blocks allocated?", 1, 2)
    assert count(store, "messages") == 6  # nothing was deleted
    with pytest.raises(ValueError, match="only the user's own messages"):
        store.edit_message("ada", chat["id"], store.messages("ada", chat["id"])[1]["id"], "I said so")


def test_a_version_is_shown_only_within_its_own_conversation(store, chat):
    other = store.create_conversation("ada", title="other")
    mine = store.messages("ada", chat["id"])[0]["id"]
    with pytest.raises(NotFound, match="message in conversation"):
        store.show_version("ada", other["id"], mine)
    with pytest.raises(NotFound, match="message in conversation"):
        store.edit_message("ada", other["id"], mine, "moved?")
    with pytest.raises(NotFound, match="conversation"):
        store.show_version("bob", chat["id"], mine)


@pytest.mark.parametrize("call, error", [
    (lambda s, c: s.create_conversation("ada", title="   "), "title"),
    (lambda s, c: s.rename("ada", c, ""), "title"),
    (lambda s, c: s.add_message("ada", c, "robot", "hi"), "unknown role 'robot'"),
    (lambda s, c: s.add_message("ada", c, "user", "  \n"), "content"),
    (lambda s, c: s.add_message("ada", c, "user", "hi", tokens=3), "unknown message metrics"),
    (lambda s, c: s.add_message("ada", c, "user", "hi", prompt_tokens="3"), "prompt_tokens"),
    (lambda s, c: s.create_conversation("", title="x"), "user id"),
])
def test_bad_input_is_refused_with_a_clear_error(store, chat, call, error):
    with pytest.raises(ValueError, match=error):
        call(store, chat["id"])
    assert len(store.messages("ada", chat["id"])) == 2


# --- isolation between users ----------------------------------------------------------------

@pytest.mark.parametrize("operation", [
    lambda s, c: s.conversation("bob", c),
    lambda s, c: s.messages("bob", c),
    lambda s, c: s.rename("bob", c, "mine now"),
    lambda s, c: s.set_system_prompt("bob", c, "obey bob"),
    lambda s, c: s.delete_conversation("bob", c),
    lambda s, c: s.add_message("bob", c, "user", "hello from bob"),
    lambda s, c: s.replace_last_assistant("bob", c, "bob's reply"),
    lambda s, c: s.edit_message("bob", c, s.messages("ada", c)[0]["id"], "bob's words"),
], ids=["read", "messages", "rename", "system_prompt", "delete", "add_message", "regenerate", "edit"])
def test_another_users_conversation_behaves_as_missing(store, chat, operation):
    before = (store.conversation("ada", chat["id"]), store.messages("ada", chat["id"]))
    with pytest.raises(NotFound, match=f"conversation {chat['id']} not found") as raised:
        operation(store, chat["id"])
    assert isinstance(raised.value, KeyError)
    assert (store.conversation("ada", chat["id"]), store.messages("ada", chat["id"])) == before


def test_listing_and_search_show_only_the_users_own(store, chat):
    assert [c["title"] for c in store.conversations("bob")] == ["Bob's chat"]
    assert store.search("bob", "blocks") == [] and store.search("bob", "paged") == []
    assert store.conversations("nobody") == [] and store.search("nobody", "blocks") == []


# --- full-text search -------------------------------------------------------------------------

def test_search_finds_conversations_by_words_in_messages_and_titles(store, chat):
    other = store.create_conversation("ada", title="Swapping to CPU")
    store.add_message("ada", other["id"], "user", "What happens under memory pressure?")
    by_message = store.search("ada", "free pool")
    assert [c["id"] for c in by_message] == [chat["id"]]
    assert "[free]" in by_message[0]["snippet"] and "[pool]" in by_message[0]["snippet"]
    assert [c["id"] for c in store.search("ada", "swapping")] == [other["id"]]   # by title
    assert [c["id"] for c in store.search("ada", "pressures")] == [other["id"]]  # stemmed
    assert store.search("ada", "free swapping") == []                            # every word
    assert store.search("ada", "   ") == []


def test_search_follows_renames_edits_and_deletes(store, chat):
    store.rename("ada", chat["id"], "Memory")
    assert store.search("ada", "attention") == []
    assert [c["title"] for c in store.search("ada", "memory")] == ["Memory"]
    store.replace_last_assistant("ada", chat["id"], "Lazily.")
    assert [c["id"] for c in store.search("ada", "lazily")] == [chat["id"]]
    assert [c["id"] for c in store.search("ada", "pool")] == [chat["id"]]  # an earlier version, still there
    store.delete_conversation("ada", chat["id"])
    assert store.search("ada", "allocated") == [] and store.search("ada", "memory") == []


@pytest.mark.parametrize("query, finds", [
    ('"free pool"', True), ('"unbalanced', False), ('""', False), ('" "', False), ("blocks*", True),
    ("(blocks)", True), ("blocks OR nothing", False), ("NOT blocks", False), ("kv:blocks", True),
    ("-x ^y", False), ("?", False),
])
def test_search_treats_any_text_as_plain_words(store, chat, query, finds):
    assert [c["id"] for c in store.search("ada", query)] == ([chat["id"]] if finds else [])


# --- integrity: cascades, foreign keys, transactions ---------------------------------------

def test_deleting_a_users_conversations_deletes_their_messages_and_keeps_the_user(store, chat):
    store.add_message("bob", store.conversations("bob")[0]["id"], "user", "Bob's blocks")
    assert store.delete_conversations("ada") == 1
    assert store.db.execute("select count(*) from conversations where user_id = 'ada'").fetchone()[0] == 0
    assert store.db.execute("select count(*) from messages join conversations c on c.id = conversation_id "
                            "where c.user_id = 'ada'").fetchone()[0] == 0
    assert (count(store, "users"), count(store, "conversations"), count(store, "messages")) == (2, 1, 1)
    assert store.search("ada", "blocks") == [] and len(store.search("bob", "blocks")) == 1
    assert store.db["users"].count_where("id = 'ada'") == 1  # signing in again finds an empty list
    assert store.delete_conversations("ada") == 0


def test_moving_conversations_gives_them_and_their_messages_to_the_other_user(store, chat):
    bobs = store.conversations("bob")
    assert store.move_conversations("ada", "hf:ada") == 1
    assert store.conversations("ada") == [] and [c["id"] for c in store.conversations("hf:ada")] == [chat["id"]]
    assert [m["content"] for m in store.messages("hf:ada", chat["id"])] == ["How are KV blocks allocated?", "From a free pool, one block at a time."]
    with pytest.raises(NotFound):
        store.messages("ada", chat["id"])
    assert store.conversations("bob") == bobs and store.move_conversations("nobody", "hf:ada") == 0
    assert [c["id"] for c in store.search("hf:ada", "blocks")] == [chat["id"]]


def test_foreign_keys_are_enforced_on_every_connection(store, chat):
    def insert_orphan():
        store.db.execute("insert into messages (conversation_id, role, content, created) "
                         "values (999, 'user', 'orphan', 'now')")

    for run in (insert_orphan, lambda: _in_thread(insert_orphan)):
        with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
            run()
    assert count(store, "messages") == 2


def _in_thread(fn):
    errors = []

    def target():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - handed back to the caller
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def test_a_transaction_that_fails_midway_leaves_nothing_written(store, chat):
    with pytest.raises(RuntimeError):
        with store.connections.transaction():
            store.add_message("ada", chat["id"], "user", "first half")
            store.rename("ada", chat["id"], "half renamed")
            raise RuntimeError("crash")
    assert len(store.messages("ada", chat["id"])) == 2
    assert store.conversation("ada", chat["id"]) == store.conversations("ada")[0]
    assert store.conversation("ada", chat["id"])["title"] == "Paged attention"


def test_adding_a_reply_and_bumping_updated_happen_together(store, chat, monkeypatch):
    before = store.conversation("ada", chat["id"])

    def crash(self, db, conversation_id):
        raise RuntimeError("crash after the insert, before the bump")

    monkeypatch.setattr(Store, "_touch", crash)
    with pytest.raises(RuntimeError):
        store.add_message("ada", chat["id"], "assistant", "half-written")
    with pytest.raises(RuntimeError):
        store.replace_last_assistant("ada", chat["id"], "half-written")
    assert store.messages("ada", chat["id"])[-1]["content"] == "From a free pool, one block at a time."
    assert store.conversation("ada", chat["id"]) == before
    assert store.search("ada", "half") == []


def test_concurrent_writers_all_land(store):
    threads, per_thread = 8, 50
    ids = [store.create_conversation(f"user{i % 3}", title=f"chat {i}")["id"] for i in range(threads)]
    errors, start = [], threading.Barrier(threads)

    def write(i):
        try:
            start.wait()
            for n in range(per_thread):
                store.add_message(f"user{i % 3}", ids[i], "user", f"message {n}")
                store.conversations(f"user{i % 3}")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    workers = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    assert count(store, "messages") == threads * per_thread
    for i, cid in enumerate(ids):
        contents = [m["content"] for m in store.messages(f"user{i % 3}", cid)]
        assert contents == [f"message {n}" for n in range(per_thread)]


# --- the database file: location, WAL, schema version ---------------------------------------

def test_the_database_is_in_wal_mode(store):
    with Database(store.path) as db:
        assert db.journal_mode == "wal"


def test_the_path_comes_from_the_environment_or_defaults_to_data(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_DB", str(tmp_path / "elsewhere" / "chats.db"))
    with Store() as s:
        assert s.path == tmp_path / "elsewhere" / "chats.db" and s.path.exists()
    monkeypatch.delenv("PAGEDCHAT_DB")
    monkeypatch.chdir(tmp_path)
    with Store() as s:
        assert s.path.resolve() == (tmp_path / "data" / "pagedchat.db").resolve() and s.path.exists()


def test_an_empty_database_is_upgraded_and_reopening_changes_nothing(tmp_path):
    path = tmp_path / "old.db"
    sqlite3.connect(path).close()  # an existing, empty database: schema version 0
    with Database(path) as db:
        assert storage.schema_version(db) == 0
    with Store(path) as s:
        assert storage.schema_version(s.db) == 5
        c = s.create_conversation("ada", title="kept")
        s.add_message("ada", c["id"], "user", "still here")
    with Store(path) as s:
        assert storage.schema_version(s.db) == 5
        assert s.db.execute("select count(*) from _sqlite_migrations").fetchone()[0] == 5
        assert [m["content"] for m in s.messages("ada", c["id"])] == ["still here"]
        assert [x["title"] for x in s.search("ada", "still")] == ["kept"]


def test_a_later_migration_upgrades_an_existing_database(tmp_path):
    path = tmp_path / "chat.db"
    with Store(path) as s:
        c = s.create_conversation("ada", title="before v2")
    later = Migrations(storage.migrations.name)
    later()(storage.schema.create_tables)
    later()(storage.schema.drop_conversation_model)
    later()(storage.schema.add_message_backend)
    later()(storage.schema.add_message_branches)
    later()(storage.schema.add_context_fitting)

    @later()
    def add_pinned(db):
        db["conversations"].add_column("pinned", int, not_null_default=0)

    db = storage.connect(path)
    storage.migrate(db, later)
    storage.migrate(db, later)  # idempotent
    assert storage.schema_version(db, later) == 6
    db.close()
    with Store(path) as s:
        assert s.conversation("ada", c["id"])["pinned"] == 0


def test_a_version_1_database_loses_the_model_column_and_keeps_every_row(tmp_path):
    path = tmp_path / "v1.db"
    v1 = Migrations(storage.migrations.name)
    v1()(storage.schema.create_tables)
    db = storage.connect(path)
    storage.migrate(db, v1)
    db["users"].insert({"id": "ada", "name": "Ada", "created": "2024-05-01T00:00:00.000000+00:00"})
    db["conversations"].insert({"id": 7, "user_id": "ada", "title": "Paged attention", "model": "smollm2",
                                "created": "2024-05-01T00:00:01.000000+00:00",
                                "updated": "2024-05-01T00:00:03.000000+00:00"})
    for n, (role, content) in enumerate([("user", "How are KV blocks allocated?"),
                                         ("assistant", "From a free pool.")], start=2):
        db["messages"].insert({"conversation_id": 7, "role": role, "content": content,
                               "created": f"2024-05-01T00:00:0{n}.000000+00:00"})
    assert "model" in db["conversations"].columns_dict
    before = {t: list(db[t].rows) for t in ("users", "conversations", "messages")}
    db.close()

    with Store(path) as s:
        assert storage.schema_version(s.db) == 5
        assert "model" not in s.db["conversations"].columns_dict
        assert list(s.db["users"].rows) == before["users"]
        question, answer = before["messages"]
        # Version 3's backend; version 4's branch, in the old order; version 5's context fitting, off.
        assert list(s.db["messages"].rows) == [
            {**question, "backend": None, "parent_id": None, "left_out": None},
            {**answer, "backend": None, "parent_id": question["id"], "left_out": None}]
        [old] = before["conversations"]
        del old["model"]
        assert s.conversations("ada") == [{**old, "leaf_id": answer["id"], "fit_context": 0}]
        assert [(m["content"], m["version"], m["versions"]) for m in s.messages("ada", 7)] == [
            ("How are KV blocks allocated?", 1, 1), ("From a free pool.", 1, 1)]
        assert [c["id"] for c in s.search("ada", "blocks")] == [7]      # the FTS triggers survive
        assert [c["id"] for c in s.search("ada", "attention")] == [7]
        s.add_message("ada", 7, "assistant", "And freed on finish.")
        s.delete_conversation("ada", 7)                                  # the cascade survives
        assert s.db["messages"].count == 0


def test_replies_keep_the_backend_that_wrote_them(tmp_path):
    with Store(tmp_path / "chat.db") as s:
        c = s.create_conversation("ada", title="routed")
        s.add_message("ada", c["id"], "user", "Hi")
        s.add_message("ada", c["id"], "assistant", "Hello", backend="10.0.0.5:8000", finish_reason="stop")
        assert s.messages("ada", c["id"])[-1]["backend"] == "10.0.0.5:8000"
        s.replace_last_assistant("ada", c["id"], "Hello again", backend="10.0.0.6:8000")
        assert s.messages("ada", c["id"])[-1]["backend"] == "10.0.0.6:8000"
        with pytest.raises(ValueError, match="backend must be str"):
            s.add_message("ada", c["id"], "assistant", "x", backend=5)


def test_a_closed_store_refuses_work(tmp_path):
    s = Store(tmp_path / "chat.db")
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.conversations("ada")
