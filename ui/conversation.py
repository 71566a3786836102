"""What the chat page does, without Gradio: `ChatController`, the sidebar list, opening,
renaming, exporting and deleting a chat, and the replies behind Send, Regenerate, the edits and
"Continue in a new chat".

Every method names the user; every store call passes it on. A user's mistake raises
`ChatInputError` (ui/chat_input.py), whose text the page shows as is; so does a conversation id
that is another user's, missing or not a whole number. A conversation has one reply in progress
at a time, and a user, a page and an address a few (ui/turns.py).

One calling convention: every method is synchronous. It checks its input and reads or writes
the store on the calling thread, which may wait for SQLite's lock, so a caller on the event loop
runs it with `asyncio.to_thread` (Gradio runs synchronous handlers on worker threads itself).
What waits for the model is handed back as an object to drive on the event loop: a reply's views
(`ReplyViews`, ui/replies.py) and a summary's `Continuation`. The method has already taken the
conversation's turn when it returns them; they hold it until they end (or are dropped), and run
their own store calls on worker threads.
"""
from __future__ import annotations

import asyncio
import functools
import os
import re
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from engine import EngineBusyError, SamplingParams
from storage import Store, transfer
from ui import presets, render
from ui.backends.backend import BackendError, ChatBackend
from ui.backends.figures import BackendStatus
from ui.chat_input import (NOT_YOURS, ChatInputError, Sliders, checked_id, checked_import_size, checked_sampling,
                           checked_text, owned)
from ui.chat_memory import ChatMemory, chat_memory, conversation_key
from ui.context_meter import ContextUse, context_use
from ui.replies import Replies, ReplyViews, last_user_index, last_user_message, previous_backend
from ui.turns import ANYWHERE, BUSY, Origin, Turn, Turns

TITLE_CHARS = 48
STOP_WAIT_S = 5.0
SUMMARY_TOKENS = 384
SUMMARY_REQUEST = ("Summarize our conversation so far for a fresh start: the facts, names, numbers, decisions "
                   "and open questions, in a few short paragraphs. Write only the summary.")
SUMMARY_HEAD = "This chat continues an earlier one. Its summary:\n"


class OpenedChat(NamedTuple):
    """A chat picked in the sidebar, as the page's fields show it."""
    messages: list[dict]
    preset: str
    custom: str
    title: str
    last_user_message: str


class Continuation:
    """A chat about to be carried on in a new one, holding the chat's turn: `await new_chat()`
    has the model summarize it and returns the new chat's id. Dropped unawaited, it gives the
    turn back when collected."""

    def __init__(self, make: Callable[[], Awaitable[int]], turn: Turn) -> None:
        self._make = make
        self._release = weakref.finalize(self, turn.release)  # runs once: here, or on collection

    async def new_chat(self) -> int:
        try:
            return await self._make()
        finally:
            self._release()


class ChatController:
    """The chat page's logic around one backend (whatever writes the replies) and one store,
    shared by all sessions."""

    def __init__(self, backend: ChatBackend, store: Store) -> None:
        self.backend = backend
        self.store = store
        # One reply at a time per conversation. Stop closes a reply's generator, which then stores
        # the partial reply on the thread that ran it; `after_stop` waits for its turn to end.
        self._turns = Turns()
        self._replies = Replies(backend, store)

    def adopt_anonymous(self, anonymous_id: str, user: str) -> int:
        """A browser signs in: the chats it wrote anonymously become the account's (the browser
        holds the anonymous id, which is what owning them means). Returns how many moved; none
        while one of them is still being replied to (the next page load moves them)."""
        if anonymous_id == user or self._turns.in_progress(anonymous_id):
            return 0
        return self.store.move_conversations(anonymous_id, user)

    # ---- the sidebar and the open chat --------------------------------------------------------
    def conversation_choices(self, user: str, query: str = "") -> list[tuple[str, int]]:
        """(label, id) for each of the user's chats, or for the search hits when `query` is set."""
        # FTS5 reads a NUL as the end of the query ("unterminated string"); it is no word anyway.
        query = checked_text(query, "search").replace("\x00", " ")
        if query.strip():
            return [(f"{c['title']} — {c['snippet']}", c["id"]) for c in self.store.search(user, query)]
        return [(c["title"], c["id"]) for c in self.store.conversations(user)]

    @owned
    def open_chat(self, user: str, conversation_id: int) -> OpenedChat:
        conversation_id = checked_id(conversation_id)
        if conversation_id is None:
            raise ChatInputError(NOT_YOURS)
        conversation = self.store.conversation(user, conversation_id)
        rows = self.store.messages(user, conversation_id)
        preset, custom = presets.preset_for(conversation["system_prompt"])
        return OpenedChat(render.chat_messages(rows), preset, custom, conversation["title"], last_user_message(rows))

    @owned
    def last_user_message(self, user: str, conversation_id: int | None) -> str:
        """What "Edit your last message" starts from: the user's last message, or ""."""
        return last_user_message(self._rows(user, conversation_id))

    @owned
    def rename(self, user: str, conversation_id: int | None, title: str) -> None:
        conversation_id = checked_id(conversation_id)
        if conversation_id is None or not checked_text(title, "title").strip():
            raise ChatInputError("Open a chat and type its new title first.")
        self.store.rename(user, conversation_id, title)

    def check_deletable(self, conversation_id: int | None) -> None:
        if checked_id(conversation_id) is None:
            raise ChatInputError("Open a chat to delete it.")

    @owned
    def delete(self, user: str, conversation_id: int | None) -> None:
        conversation_id = checked_id(conversation_id)
        if self._turns.busy(user, conversation_id):
            raise ChatInputError(BUSY)  # its reply would have nowhere to go
        if conversation_id is not None:
            self.store.delete_conversation(user, conversation_id)

    @owned
    def context(self, user: str, conversation_id: int | None) -> tuple[ContextUse, bool]:
        """How full the chat's context is (the engine's numbers from its latest reply, the
        backend's limit) and whether it leaves out its oldest turns when full."""
        conversation_id = checked_id(conversation_id)
        rows = self._rows(user, conversation_id)
        status = self._status_for(rows)
        use = context_use(rows, status.model if status else None, status.max_model_len if status else None)
        fit = conversation_id is not None and self._fits_context(user, conversation_id)
        return use, fit

    @owned
    def memory(self, user: str, conversation_id: int | None) -> tuple[ChatMemory | None, str | None]:
        """The chat's KV blocks now, from its backend's block map (None where it shows none),
        and the key its requests go by (a new chat's first reply has its own)."""
        conversation_id = checked_id(conversation_id)
        if conversation_id is None:
            return None, None
        status = self._status_for(self._rows(user, conversation_id))
        keys = {conversation_key(conversation_id)}
        live = self._replies.live_key(user, conversation_id)
        keys |= {live} if live else set()
        found = self.backend.block_map(status.name) if status is not None and status.up else None
        return (chat_memory(found[0], keys) if found else None), live or conversation_key(conversation_id)

    def _status_for(self, rows: list[dict]) -> BackendStatus | None:
        """The backend a chat's next turn most likely goes to: the one that wrote its last reply,
        else the first one up."""
        statuses = self.backend.statuses()
        wrote = previous_backend(rows)
        return next((s for s in statuses if s.name == wrote), None) or next((s for s in statuses if s.up), None) \
            or (statuses[0] if statuses else None)

    @owned
    def set_fit_context(self, user: str, conversation_id: int | None, on: bool) -> None:
        conversation_id = checked_id(conversation_id)
        if conversation_id is None:
            raise ChatInputError("Send a message first: the choice is kept with the chat.")
        self.store.set_fit_context(user, conversation_id, bool(on))

    @owned
    def continue_with_summary(self, user: str, conversation_id: int | None, sliders: Sliders,
                              origin: Origin = ANYWHERE) -> Continuation:
        """A new chat that carries this one on, once the returned continuation's `new_chat()` is
        awaited: the model summarizes this chat (not stored here), and the summary joins the system
        prompt of the new chat, which is empty and ready for the next message. The call checks
        the input, takes this chat's turn and reads it (ChatInputError now, if it may not)."""
        conversation_id = checked_id(conversation_id)
        if conversation_id is None:
            raise ChatInputError("Open a chat to continue it.")
        sampling = checked_sampling((sliders[0], sliders[1], SUMMARY_TOKENS))
        with self._turn(user, conversation_id, origin) as turn:
            conversation = self.store.conversation(user, conversation_id)
            rows = self._rows(user, conversation_id)
            if not rows:
                raise ChatInputError("This chat has nothing to summarize yet.")
            return Continuation(functools.partial(self._continued, user, conversation_id, conversation, rows,
                                                  sampling), turn)

    async def _continued(self, user: str, conversation_id: int, conversation: dict, rows: list[dict],
                         sampling: SamplingParams) -> int:
        """The new chat with the model's summary of `rows` in its system prompt; returns its id."""
        request = rows + [{"role": "user", "content": SUMMARY_REQUEST}]
        try:
            reply = await self._replies.start_fitted(conversation["system_prompt"], request, sampling,
                                                     conversation_id, user, fit=True)
        except (ValueError, EngineBusyError, BackendError) as error:
            raise ChatInputError(f"The chat could not be summarized ({error}). Try again in a moment.") from None
        try:
            async for _ in reply:
                pass
        finally:
            await reply.aclose()
        if reply.finish_reason not in ("stop", "length") or not reply.text.strip():
            raise ChatInputError("The model gave no summary. Try again, or start a new chat.")
        system_prompt = (conversation["system_prompt"].rstrip() + "\n\n" if conversation["system_prompt"].strip()
                         else "") + SUMMARY_HEAD + reply.text.strip()
        title = f"{conversation['title'][:TITLE_CHARS]} (continued)"
        new = await asyncio.to_thread(self.store.create_conversation, user, title, system_prompt)
        return new["id"]

    def delete_all(self, user: str) -> int:
        """Every chat of the user's; returns how many. Not while one of their replies is being
        written: it would have nowhere to go."""
        if self._turns.in_progress(user):
            raise ChatInputError("A reply is still being written: stop it or wait for it, then delete your chats.")
        return self.store.delete_conversations(user)

    @owned
    def export(self, user: str, conversation_id: int | None, folder: str | os.PathLike) -> list[Path]:
        """The open chat as Markdown and JSON files in `folder`, named after its title."""
        conversation_id = checked_id(conversation_id)
        if conversation_id is None:
            raise ChatInputError("Open a chat to export it.")
        title = self.store.conversation(user, conversation_id)["title"]
        stem = "-".join(re.findall(r"\w+", title.lower()))[:60] or "chat"
        files = [Path(folder, f"{stem}.md"), Path(folder, f"{stem}.json")]
        files[0].write_text(transfer.conversation_markdown(self.store, user, conversation_id), encoding="utf-8")
        files[1].write_text(transfer.conversation_json(self.store, user, conversation_id), encoding="utf-8")
        return files

    def import_file(self, user: str, path: str | os.PathLike) -> int:
        """A chat from an exported JSON file, as a new chat of the user's; returns its id."""
        checked_import_size(path)
        try:
            return transfer.import_conversation(self.store, user, Path(path).read_bytes())["id"]
        except transfer.NotAConversation as error:
            raise ChatInputError(f"{error} Nothing was imported.") from None

    def replying(self, user: str, conversation_id: int | None) -> bool:
        """Whether a reply is being written in the user's conversation now."""
        try:
            return self._turns.busy(user, checked_id(conversation_id))
        except ChatInputError:
            return False

    @owned
    def after_stop(self, user: str, conversation_id: int | None, timeout: float = STOP_WAIT_S) -> list[dict]:
        """After Stop: wait (briefly) for the stopped reply to be stored, then the chat as stored,
        so the reply carries its "stopped" mark."""
        conversation_id = checked_id(conversation_id)
        self._turns.wait(user, conversation_id, timeout)
        return render.chat_messages(self._rows(user, conversation_id))

    # ---- replies: each says what differs, `_reply` does the rest. Each checks its input and takes
    # ---- replies: each says what differs, `_reply` does the rest. Each checks its input and takes
    # the conversation's turn when called, and returns the reply's views: nothing is submitted or
    # stored until they are iterated.
    @owned
    def send(self, user: str, conversation_id: int | None, message: str, system_prompt: str,
             sliders: Sliders, origin: Origin = ANYWHERE) -> ReplyViews:
        """The views of a new user message and its reply, which send nothing until iterated: the
        call checks the input and takes the conversation's turn (ChatInputError now, if it may
        not); iterating submits the prompt, stores the message (the first one creates the
        conversation, titled from it) and streams the reply. A prompt the engine refuses stores
        nothing."""
        conversation_id = checked_id(conversation_id)
        text = checked_text(message, "message").strip()
        system_prompt = checked_text(system_prompt, "system prompt")
        if not text:
            raise ChatInputError("Type a message first.")
        sampling = checked_sampling(sliders)
        with self._turn(user, conversation_id, origin) as turn:
            rows = self._rows(user, conversation_id) + [{"role": "user", "content": text}]
            return self._replies.views(turn, user, conversation_id, system_prompt, rows, sampling,
                                       functools.partial(self._store_message, user, conversation_id, text,
                                                         system_prompt),
                                       self._add_reply)

    def _store_message(self, user: str, conversation_id: int | None, text: str, system_prompt: str) -> int:
        """Send's user side: the message stored (in a new conversation, titled from it, if none is
        open; with the system prompt as now chosen); returns the conversation's id."""
        with self.store.transaction():  # never a new conversation without its first message
            if conversation_id is None:
                conversation_id = self.store.create_conversation(user, title=text[:TITLE_CHARS],
                                                                 system_prompt=system_prompt)["id"]
            elif self.store.conversation(user, conversation_id)["system_prompt"] != system_prompt:
                self.store.set_system_prompt(user, conversation_id, system_prompt)
            self.store.add_message(user, conversation_id, "user", text)
        return conversation_id

    @owned
    def regenerate(self, user: str, conversation_id: int | None, sliders: Sliders,
                   origin: Origin = ANYWHERE) -> ReplyViews:
        """A new reply in place of the last one (or a reply to a last message that has none)."""
        conversation_id = checked_id(conversation_id)
        sampling = checked_sampling(sliders)
        with self._turn(user, conversation_id, origin) as turn:
            rows = self._rows(user, conversation_id)
            if not rows:
                raise ChatInputError("Nothing to regenerate yet.")
            replacing = rows[-1]["role"] == "assistant"
            return self._replies.views(turn, user, conversation_id, self._system_prompt(user, conversation_id),
                                       rows[:-1] if replacing else rows, sampling, None,
                                       self._replace_reply if replacing else self._add_reply)

    @owned
    def edit_last(self, user: str, conversation_id: int | None, edited: str, sliders: Sliders,
                  origin: Origin = ANYWHERE) -> ReplyViews:
        """The user's last message replaced by `edited` and a new reply (the old version and its
        reply are kept, as `edit_message` keeps them)."""
        rows = self._rows(user, checked_id(conversation_id))
        return self.edit_message(user, conversation_id, last_user_index(rows), edited, sliders, shown_text=False,
                                 origin=origin)

    @owned
    def edit_message(self, user: str, conversation_id: int | None, index: int | None, edited: str,
                     sliders: Sliders, shown_text: bool = True, origin: Origin = ANYWHERE) -> ReplyViews:
        """A new version of the user message at `index` in the chat shown (the chatbot's edit
        gives its index and the box's text, which starts from the message as shown unless not
        `shown_text`): the chat forks there and the new version gets a reply. The old version
        and all that followed it are kept, one `‹ ›` away."""
        conversation_id = checked_id(conversation_id)
        text = checked_text(edited, "edited message")
        text = (render.source_of(text) if shown_text else text).strip()
        with self._turn(user, conversation_id, origin) as turn:
            rows = self._rows(user, conversation_id)
            if index is None or not isinstance(index, int) or not 0 <= index < len(rows) \
                    or rows[index]["role"] != "user" or not text:
                raise ChatInputError("There is no sent message to edit there, or the edit is empty.")
            sampling = checked_sampling(sliders)
            message_id = rows[index]["id"]

            def store_edit() -> int:
                self.store.edit_message(user, conversation_id, message_id, text)
                return conversation_id

            return self._replies.views(turn, user, conversation_id, self._system_prompt(user, conversation_id),
                                       rows[:index] + [{"role": "user", "content": text}], sampling, store_edit,
                                       self._add_reply)

    @owned
    def show_version(self, user: str, conversation_id: int | None, message_id: object) -> list[dict]:
        """The chat shown through another version of one of its messages (a `‹ ›` click). Not
        while a reply is being written in it: the reply belongs to the branch it started on."""
        conversation_id = checked_id(conversation_id)
        try:
            message_id = int(str(message_id).strip())
        except ValueError:
            raise ChatInputError(f"A message id is a whole number, not {message_id!r}.") from None
        if conversation_id is None:
            raise ChatInputError(NOT_YOURS)
        if self._turns.busy(user, conversation_id):
            raise ChatInputError(BUSY)
        return render.chat_messages(self.store.show_version(user, conversation_id, message_id))

    @contextmanager
    def _turn(self, user: str, conversation_id: int | None, origin: Origin) -> Iterator[Turn]:
        """The conversation's turn, taken before the reply reads or stores anything (BUSY if
        another reply holds it); released here if the reply never gets going."""
        turn = self._turns.start(user, conversation_id, origin)
        try:
            yield turn
        except BaseException:
            turn.release()
            raise

    def _add_reply(self, user: str, conversation_id: int, text: str, metrics: dict) -> dict:
        return self.store.add_message(user, conversation_id, "assistant", text, **metrics)

    def _replace_reply(self, user: str, conversation_id: int, text: str, metrics: dict) -> dict:
        return self.store.replace_last_assistant(user, conversation_id, text, **metrics)

    def _rows(self, user: str, conversation_id: int | None) -> list[dict]:
        return self.store.messages(user, conversation_id) if conversation_id else []

    def _fits_context(self, user: str, conversation_id: int) -> bool:
        return bool(self.store.conversation(user, conversation_id)["fit_context"])

    def _system_prompt(self, user: str, conversation_id: int) -> str:
        return self.store.conversation(user, conversation_id)["system_prompt"]
