"""Backups of the chat database (storage/backup.py, storage/hub_backup.py), with real files: the
snapshot is consistent while replies are being written, a restore brings back every finished
reply, and a hub that cannot be reached never blocks or breaks the chat."""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from served_app import Served, free_port

from storage import Store
from storage.backup import SNAPSHOT_NAME, BackupLoop, CorruptSnapshot, integrity_problem, restore, snapshot
from storage.hub_backup import from_environment, start_hub_backup

NOWHERE = f"http://127.0.0.1:{free_port()}"  # a hub address where nothing listens
REPO = "ada/pagedchat-backups"


class FakeHub:
    """The hub routes a backup uses (the repo's info, download a file, create the repo, pre-upload,
    commit), on a real loopback server, keeping what is committed in `files`. With `failing`,
    downloads and uploads are refused (403, as for a token without the rights), which
    huggingface_hub does not retry. A file not there is answered as the hub does: 404, for a
    missing repo or a missing file. `private`: the existing repo's visibility (a new one's is
    what its creator asks)."""

    def __init__(self, failing: bool, repo_exists: bool = True, private: bool = True) -> None:
        self.failing, self.repo_exists, self.private, self.files = failing, repo_exists, private, {}
        app = FastAPI()

        @app.post("/api/repos/create")
        async def create(request: Request):
            body = await request.json()
            if not self.repo_exists:  # `private` applies to a new repo only, as on the hub
                self.repo_exists = True
                self.private = body.get("visibility") == "private" or body.get("private") is True
            return {"url": f"{self.url}/datasets/{body['organization']}/{body['name']}"}

        @app.get("/api/datasets/{owner}/{name}")
        async def info(owner: str, name: str):
            if not self.repo_exists:
                return JSONResponse({"error": "RepoNotFound"}, status_code=404,
                                    headers={"X-Error-Code": "RepoNotFound"})
            return {"id": f"{owner}/{name}", "private": self.private, "sha": "0" * 40}

        @app.api_route("/datasets/{owner}/{name}/resolve/{revision}/{filename}", methods=["GET", "HEAD"])
        async def download(owner: str, name: str, revision: str, filename: str):
            if self.failing:
                return JSONResponse({"error": "this token may not read here"}, status_code=403)
            if filename not in self.files:
                code = "EntryNotFound" if self.repo_exists else "RepoNotFound"
                return JSONResponse({"error": code}, status_code=404, headers={"X-Error-Code": code})
            data = self.files[filename]
            return Response(data, headers={"X-Repo-Commit": "0" * 40, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'})

        @app.post("/api/datasets/{owner}/{name}/preupload/{revision}")
        async def preupload(owner: str, name: str, revision: str, request: Request):
            if self.failing:
                return JSONResponse({"error": "this token may not write here"}, status_code=403)
            files = (await request.json())["files"]
            return {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}

        @app.post("/api/datasets/{owner}/{name}/commit/{revision}")
        async def commit(owner: str, name: str, revision: str, request: Request):
            for line in (await request.body()).decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return {"commitUrl": f"{self.url}/datasets/{owner}/{name}/commit/{'0' * 40}", "commitOid": "0" * 40}

        self.served = Served(app)
        self.url = self.served.url.rstrip("/")


def write_chats(store: Store, user: str, chats: int, turns: int = 2) -> dict[int, list[str]]:
    """Chats of `turns` user/assistant exchanges; {conversation id: contents in order}."""
    written = {}
    for c in range(chats):
        chat = store.create_conversation(user, title=f"{user} chat {c}")
        contents = []
        for t in range(turns):
            for role in ("user", "assistant"):
                text = f"{user} {c}.{t} {role}"
                store.add_message(user, chat["id"], role, text)
                contents.append(text)
        written[chat["id"]] = contents
    return written


def all_messages(store: Store, user: str) -> dict[int, list[str]]:
    return {c["id"]: [m["content"] for m in store.messages(user, c["id"])] for c in store.conversations(user)}


def remove_database(path) -> None:
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.unlink(f"{path}{suffix}")


def test_a_snapshot_taken_while_replies_are_written_is_always_consistent(tmp_path):
    store = Store(tmp_path / "chat.db")
    stop = threading.Event()

    def writer(user: str) -> None:
        chat = store.create_conversation(user, title="busy")
        i = 0
        while not stop.is_set():
            # A turn is two writes; a reply's text grows with i so pages split and move.
            store.add_message(user, chat["id"], "user", f"question {i}")
            store.add_message(user, chat["id"], "assistant", f"answer {i} " + "x" * (i % 500))
            i += 1

    writers = [threading.Thread(target=writer, args=(f"user{n}",)) for n in range(3)]
    for thread in writers:
        thread.start()
    try:
        for n in range(15):
            time.sleep(0.05)
            copy = snapshot(store.path, tmp_path / "snapshots")
            assert integrity_problem(copy) is None
            with sqlite3.connect(copy) as connection:
                assert connection.execute("pragma foreign_key_check").fetchall() == []
                rows = connection.execute("select conversation_id, role, content from messages order by id").fetchall()
            per_chat: dict[int, list[tuple[str, str]]] = {}
            for conversation_id, role, content in rows:
                per_chat.setdefault(conversation_id, []).append((role, content))
            for turns in per_chat.values():  # every chat's messages in order, none skipped
                for i, (role, content) in enumerate(turns):
                    kind, number = ("question", i // 2) if i % 2 == 0 else ("answer", i // 2)
                    assert role == ("user" if kind == "question" else "assistant")
                    assert content.split()[:2] == [kind, str(number)]
            assert not (copy.parent / (SNAPSHOT_NAME + "-wal")).exists()  # a self-contained file
    finally:
        stop.set()
        for thread in writers:
            thread.join()
    assert len(rows) > 0
    store.close()


def test_a_restore_brings_back_every_finished_reply(tmp_path):
    db = tmp_path / "data" / "chat.db"
    with Store(db) as store:
        written = {user: write_chats(store, user, chats=4) for user in ("anon:" + "a" * 32, "hf:ada")}
        copy = snapshot(db, tmp_path / "backup")
    remove_database(db)
    assert restore(copy, db)
    with Store(db) as store:
        assert {user: all_messages(store, user) for user in written} == written
        assert len(store.search("hf:ada", "assistant")) == 4


def test_a_restore_never_overwrites_a_database_and_refuses_a_corrupt_snapshot(tmp_path):
    db, other = tmp_path / "chat.db", tmp_path / "other.db"
    with Store(other) as store:
        write_chats(store, "hf:ada", chats=1)
    with Store(db) as store:
        write_chats(store, "hf:bob", chats=2)
        before = all_messages(store, "hf:bob")
    copy = snapshot(other, tmp_path / "backup")
    assert not restore(copy, db)  # the live database stays
    with Store(db) as store:
        assert all_messages(store, "hf:bob") == before and store.conversations("hf:ada") == []
    assert not restore(tmp_path / "no-such-snapshot.db", tmp_path / "new.db")

    gone = tmp_path / "gone.db"  # deleted while its write-ahead log still held commits
    with Store(gone) as store:
        write_chats(store, "hf:cy", chats=1)
        shutil.copy(f"{gone}-wal", tmp_path / "kept-wal")
    gone.unlink()
    (tmp_path / "kept-wal").rename(f"{gone}-wal")
    with pytest.raises(FileExistsError, match="left from a deleted database"):
        restore(copy, gone)  # else SQLite would lay cy's pages over ada's snapshot
    assert not gone.exists()

    data = bytearray(copy.read_bytes())
    data[200:4096] = b"\xff" * (4096 - 200)  # the first page's b-tree, past the 100-byte header
    copy.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshot, match="integrity check"):
        restore(copy, tmp_path / "new.db")
    assert not (tmp_path / "new.db").exists()


def test_the_loop_snapshots_changes_only_and_survives_a_failing_snapshot(tmp_path, caplog):
    db, folder = tmp_path / "chat.db", tmp_path / "backup"
    store = Store(db)
    loop = BackupLoop(db, folder, interval_s=3600)  # ticks by hand below
    try:
        assert loop.take_if_changed() and not loop.take_if_changed()  # nothing new: no snapshot
        write_chats(store, "hf:ada", chats=1)
        assert loop.take_if_changed() and loop.snapshots == 2

        # A commit that leaves the files' sizes and mtimes as they were (a WAL reused after a
        # checkpoint, a coarse clock) is still a change.
        store.db.execute("pragma wal_checkpoint(restart)")
        loop.take_if_changed()  # a checkpoint may or may not count as a change; either way, now seen
        wal = db.with_name(db.name + "-wal")
        before = {path: path.stat() for path in (db, wal)}
        write_chats(store, "hf:ada", chats=1)
        for path, stat in before.items():
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            assert path.stat().st_size == stat.st_size
        assert loop.take_if_changed() and not loop.take_if_changed()

        shutil.rmtree(folder)
        folder.write_text("a file where the snapshot folder should be")  # a real failure, even for root
        write_chats(store, "hf:ada", chats=1)
        with caplog.at_level(logging.ERROR, logger="pagedchat.backup"):
            assert not loop.take_if_changed()
        assert loop.failures == 1 and "snapshot" in caplog.text
        write_chats(store, "hf:ada", chats=1)  # the chat goes on
        folder.unlink()
        assert loop.take_if_changed()  # and the next tick catches up
    finally:
        loop.stop()
    with sqlite3.connect(folder / SNAPSHOT_NAME) as connection:
        assert connection.execute("select count(*) from conversations").fetchone() == (4,)
    store.close()


def test_an_unreachable_hub_never_blocks_or_breaks_the_chat(tmp_path, caplog):
    db = tmp_path / "data" / "chat.db"
    with Store(db) as store:
        written = write_chats(store, "hf:ada", chats=2)
        started = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="pagedchat.backup"):
            backup = start_hub_backup(db, "ada/pagedchat-backups", "hf_not_a_token", endpoint=NOWHERE)
        assert time.monotonic() - started < 5
        assert backup.scheduler is None and "cannot reach the backup repository" in caplog.text
        written.update(write_chats(store, "hf:ada", chats=1))  # the chat goes on
        started = time.monotonic()
        backup.close(wait_s=5)
        assert time.monotonic() - started < 5
        assert all_messages(store, "hf:ada") == written
    with Store(db.parent / "backup" / SNAPSHOT_NAME) as copy:  # snapshots are still taken, locally
        assert all_messages(copy, "hf:ada") == written


def test_a_failed_restore_starts_empty_and_never_uploads_over_the_repos_copy(tmp_path, caplog):
    """The snapshot cannot be read at start: the app starts with an empty database, whose upload
    would replace everyone's chats in the repo, so it is backed up locally only."""
    hub = FakeHub(failing=True)
    db = tmp_path / "data" / "chat.db"
    try:
        with caplog.at_level(logging.ERROR, logger="pagedchat.backup"):
            backup = start_hub_backup(db, REPO, "hf_token", endpoint=hub.url)
        assert not db.exists() and backup.scheduler is None and "no database restored" in caplog.text
        with Store(db) as store:
            written = write_chats(store, "hf:ada", chats=1)
            backup.close(wait_s=5)
    finally:
        hub.served.close()
    with Store(db.parent / "backup" / SNAPSHOT_NAME) as copy:
        assert all_messages(copy, "hf:ada") == written


def test_the_environment_turns_the_backup_on_and_says_what_is_missing(tmp_path):
    assert from_environment(tmp_path / "chat.db", {}) is None
    with pytest.raises(ValueError, match="HF_TOKEN is not"):
        from_environment(tmp_path / "chat.db", {"PAGEDCHAT_BACKUP_REPO": "ada/backups"})
    with pytest.raises(ValueError, match="positive number of minutes"):
        from_environment(tmp_path / "chat.db", {"PAGEDCHAT_BACKUP_REPO": "ada/backups", "HF_TOKEN": "t",
                                                "PAGEDCHAT_BACKUP_MINUTES": "soon"})


@pytest.mark.parametrize("failing", [False, True])
def test_the_scheduler_uploads_the_snapshot_and_a_failing_upload_breaks_nothing(tmp_path, caplog, failing):
    hub = FakeHub(failing)
    db = tmp_path / "data" / "chat.db"
    try:
        with Store(db) as store:
            written = write_chats(store, "hf:ada", chats=2)
            backup = start_hub_backup(db, REPO, "hf_token", endpoint=hub.url)
            assert backup.scheduler is not None and backup.loop.take_if_changed()
            upload = backup.scheduler.trigger()
            written.update(write_chats(store, "hf:ada", chats=1))  # the chat goes on meanwhile
            if failing:
                with pytest.raises(Exception, match="403"):
                    upload.result(timeout=60)
            else:
                upload.result(timeout=60)
                assert backup.scheduler.trigger().result(timeout=60) is None  # unchanged: nothing sent
            started = time.monotonic()
            with caplog.at_level(logging.ERROR, logger="pagedchat.backup"):
                backup.close(wait_s=5)  # a last snapshot (the third chat) and a last upload
            assert time.monotonic() - started < 10
            assert all_messages(store, "hf:ada") == written
    finally:
        hub.served.close()
    if failing:
        assert hub.files == {} and "last upload of the database" in caplog.text
    else:
        (tmp_path / "uploaded.db").write_bytes(hub.files[SNAPSHOT_NAME])
        assert restore(tmp_path / "uploaded.db", tmp_path / "restored.db")
        with Store(tmp_path / "restored.db") as restored:
            assert all_messages(restored, "hf:ada") == written


@pytest.mark.parametrize("repo_exists", [False, True])
def test_a_restart_restores_every_chat_from_the_hub(tmp_path, caplog, repo_exists):
    """First start: the repo is missing or holds no database, so the app starts empty and
    uploads. A restart on a fresh disk downloads that upload and restores every chat."""
    hub = FakeHub(failing=False, repo_exists=repo_exists)
    db = tmp_path / "data" / "chat.db"
    caplog.set_level(logging.WARNING, logger="pagedchat.backup")
    try:
        backup = start_hub_backup(db, REPO, "hf_token", endpoint=hub.url)
        assert not db.exists() and backup.scheduler is not None and "holds no database yet" in caplog.text
        with Store(db) as store:
            written = write_chats(store, "hf:ada", chats=3)
            backup.close(wait_s=10)  # the last snapshot, uploaded
        assert SNAPSHOT_NAME in hub.files

        shutil.rmtree(db.parent)  # the Space restarts: its disk is new
        backup = start_hub_backup(db, REPO, "hf_token", endpoint=hub.url)
        assert backup.scheduler is not None and "restored the database" in caplog.text
        with Store(db) as store:
            assert all_messages(store, "hf:ada") == written
            written.update(write_chats(store, "hf:ada", chats=1))
            backup.close(wait_s=10)
    finally:
        hub.served.close()
    (tmp_path / "uploaded.db").write_bytes(hub.files[SNAPSHOT_NAME])
    assert restore(tmp_path / "uploaded.db", tmp_path / "restored.db")
    with Store(tmp_path / "restored.db") as restored:
        assert all_messages(restored, "hf:ada") == written


@pytest.mark.parametrize("private", [True, False], ids=["private", "public"])
def test_a_public_repository_is_restored_from_but_never_uploaded_to(tmp_path, caplog, private):
    """`private=True` applies only when the repo is created: an existing public one would publish
    every chat. It is still read at start (what it holds is public already, and restoring keeps
    the chats), but nothing is uploaded to it."""
    with Store(tmp_path / "before.db") as before:
        written = write_chats(before, "hf:ada", chats=2)
    hub = FakeHub(failing=False, private=private)
    hub.files[SNAPSHOT_NAME] = snapshot(tmp_path / "before.db", tmp_path / "before").read_bytes()
    original = hub.files[SNAPSHOT_NAME]
    db = tmp_path / "data" / "chat.db"
    caplog.set_level(logging.WARNING, logger="pagedchat.backup")
    try:
        backup = start_hub_backup(db, REPO, "hf_token", endpoint=hub.url)
        assert "restored the database" in caplog.text
        with Store(db) as store:
            assert all_messages(store, "hf:ada") == written
            written.update(write_chats(store, "hf:ada", chats=1))
            backup.close(wait_s=10)  # the last snapshot, and an upload if the repo is private
    finally:
        hub.served.close()
    refusal = f"{REPO} is a public dataset"
    if private:
        assert hub.files[SNAPSHOT_NAME] != original and refusal not in caplog.text
        (tmp_path / "uploaded.db").write_bytes(hub.files[SNAPSHOT_NAME])
        assert restore(tmp_path / "uploaded.db", tmp_path / "restored.db")
        with Store(tmp_path / "restored.db") as restored:
            assert all_messages(restored, "hf:ada") == written
    else:
        assert hub.files[SNAPSHOT_NAME] == original, "a chat was published"
        assert refusal in caplog.text and "make it private" in caplog.text, caplog.text
    with Store(db.parent / "backup" / SNAPSHOT_NAME) as local:  # snapshots are taken either way, locally
        assert all_messages(local, "hf:ada") == written
