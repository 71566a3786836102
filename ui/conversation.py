"""What the chat page does, without Gradio: the sidebar list, opening, renaming and deleting a
chat, and the reply flow behind Send, Regenerate and Resend edited message.

Every method names the user; every store call passes it on. A user's mistake raises
`ChatInputError`, whose text the page shows as is; so does a conversation id that is another
user's, missing or not a whole number (the store's `NotFound`, worded so as never to say which).
A reply is an async iterator of `ChatView`s: the page shows each as it comes, and waiting for the
next token holds no thread. Closing it mid-reply, or cancelling the task that reads it (the Stop
button, a browser gone), aborts the engine request and stores the partial reply as stopped. A
conversation has one reply in progress at a time; a user at most MAX_REPLIES_PER_USER, and since
an anonymous user id is whatever the browser (or a script) says, so has a page (Gradio session)
and a client address at most MAX_REPLIES_PER_SESSION and MAX_REPLIES_PER_ADDRESS (the turn's
`Origin`). A turn beyond any of them is refused with a message, before anything is stored.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from engine import EngineBusyError, SamplingParams
from storage import NotFound, Store, transfer
from ui import params, presets, render
from ui.backends.figures import BackendStatus
from ui.chat_memory import ChatMemory, chat_memory, conversation_key
from ui.context_meter import ContextUse, context_use
from ui.backends.backend import BackendError, ChatBackend
from ui.stream import ReplyStream, paced, start_reply

log = logging.getLogger(__name__)

TITLE_CHARS = 48
# Longer text is refused before it is tokenized (on the engine's thread) or stored. 100k
# characters is ~25k tokens, beyond the context of the models this app serves; the engine refuses
# a shorter prompt that still does not fit its KV cache.
MAX_TEXT_CHARS = 100_000
STOP_WAIT_S = 5.0
# A streaming reply is redrawn at most this often: each redraw costs the page (Gradio's
# postprocessing and diff of the whole chat) far more than a token, and ~20 a second reads as smooth.
VIEW_INTERVAL_S = 0.05
MAX_CONVERSATION_ID = 2**63 - 1  # SQLite's largest integer: beyond it no row can exist
SUMMARY_TOKENS = 384
SUMMARY_REQUEST = ("Summarize our conversation so far for a fresh start: the facts, names, numbers, decisions "
                   "and open questions, in a few short paragraphs. Write only the summary.")
SUMMARY_HEAD = "This chat continues an earlier one. Its summary:\n"
MAX_IMPORT_BYTES = 5_000_000  # an exported chat of ~1,000 long turns
MAX_REPLIES_PER_USER = 4  # replies one user may have in progress at once, across their chats
NOT_YOURS = "That conversation doesn't exist or isn't yours."
BUSY = "A reply is still being written in this chat: wait for it or press Stop."
TOO_MANY = (f"You already have {MAX_REPLIES_PER_USER} replies being written: wait for one to finish "
            "(or stop one), then try again. Nothing was sent.")
MAX_REPLIES_PER_SESSION = MAX_REPLIES_PER_USER  # per page (Gradio session): one page is one user
MAX_REPLIES_PER_ADDRESS = 16  # per client address: a few people behind one network, or one script
TOO_MANY_IN_PAGE = (f"This page already has {MAX_REPLIES_PER_SESSION} replies being written: wait for one to "
                    "finish (or stop one), then try again. Nothing was sent.")
TOO_MANY_FROM_ADDRESS = (f"{MAX_REPLIES_PER_ADDRESS} replies are already being written for your network address: "
                         "wait for one to finish (or stop one), then try again. Nothing was sent.")
UNSAVED_MESSAGE = "Your message could not be saved (a storage error): nothing was sent. Try again in a moment."
UNSAVED_REPLY = ("This reply could not be saved (a storage error): it is shown here, but it will not be in "
                 "the chat when you open it again. Copy what you need, or regenerate it.")
BUSY_ENGINE = "The server is busy with other chats right now: nothing was sent. Try again in a moment."

# (temperature, top_p, max new tokens) as the sliders give them; checked by the controller.
Sliders = tuple[float, float, float]
# Stores a finished or stopped reply: (user, conversation id, text, metrics) -> the stored row.
SaveReply = Callable[[str, int, str, dict], dict]


class ChatInputError(ValueError):
    """Something the user must change before the page can act; its text is shown to them."""


@contextmanager
def found() -> Iterator[None]:
    """The store's `NotFound` as the one message a user sees: it never says whether the
    conversation exists for someone else."""
    try:
        yield
    except NotFound:
        raise ChatInputError(NOT_YOURS) from None


def owned(method):
    """A controller method whose `NotFound` the user sees as `NOT_YOURS`."""
    @functools.wraps(method)
    def checked(*args, **kwargs):
        with found():
            return method(*args, **kwargs)
    return checked


class ChatView(NamedTuple):
    """The chat as the chatbot shows it now, and the conversation it belongs to (None until the
    first reply creates it). `refused`: the engine would not take the prompt; nothing was stored."""
    messages: list[dict]
    conversation_id: int | None
    refused: bool = False


class OpenedChat(NamedTuple):
    """A chat picked in the sidebar, as the page's fields show it."""
    messages: list[dict]
    preset: str
    custom: str
    title: str
    last_user_message: str


@dataclass(frozen=True)
class Origin:
    """Where a turn comes from, beyond the user id it claims: its page (Gradio's session hash)
    and its client's address (ui/identity.py's `origin_of`). None where unknown, and an address
    of None for a request made on this machine itself, which is not limited per address."""
    session: str | None = None
    address: str | None = None


ANYWHERE = Origin()  # a caller in this process (tests, tools): limited per user only


class Turn:
    """One reply's hold on its reply slots (its user's, page's and address's) and its
    conversation; `release()` may be called any number of times."""

    def __init__(self, turns: Turns, user: str, slots: list[tuple[str, str]]) -> None:
        self._turns, self.user = turns, user
        self._held: list[int] = []
        self._slots = slots  # Turns.start took them
        self._lock = threading.Lock()

    def hold(self, conversation_id: int) -> None:
        """Hold `conversation_id`, or ChatInputError(BUSY) if another reply holds it."""
        self._turns._take(self.user, conversation_id)
        with self._lock:
            self._held.append(conversation_id)

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, []
            slots, self._slots = self._slots, []
        for conversation_id in held:
            self._turns._release(self.user, conversation_id)
        self._turns._free_slots(slots)


class Turns:
    """The replies in progress: one per conversation, at most `max_per_user` per user, and as
    many per page and per client address; thread-safe. Conversations are keyed with their owner,
    so asking about another user's id says nothing."""

    def __init__(self, max_per_user: int = MAX_REPLIES_PER_USER, max_per_session: int = MAX_REPLIES_PER_SESSION,
                 max_per_address: int = MAX_REPLIES_PER_ADDRESS) -> None:
        # slot kind -> (most at once, the refusal beyond it)
        self._limits = {"user": (max_per_user, TOO_MANY), "session": (max_per_session, TOO_MANY_IN_PAGE),
                        "address": (max_per_address, TOO_MANY_FROM_ADDRESS)}
        self._lock = threading.Lock()
        # (user, conversation) with a reply in progress -> set once that reply has ended and been stored
        self._replying: dict[tuple[str, int], threading.Event] = {}
        self._in_progress: dict[tuple[str, str], int] = {}  # (kind, key) -> replies in progress

    def start(self, user: str, conversation_id: int | None, origin: Origin = ANYWHERE) -> Turn:
        """A turn holding a slot of the user's, of its page's and of its address's, and
        `conversation_id` (a new conversation is held once created); TOO_MANY (or the page's or
        the address's refusal) or BUSY if it may not start."""
        slots = [("user", user)] + [(kind, key) for kind, key in (("session", origin.session),
                                                                 ("address", origin.address)) if key]
        with self._lock:
            for slot in slots:
                most, refusal = self._limits[slot[0]]
                if self._in_progress.get(slot, 0) >= most:
                    raise ChatInputError(refusal)
            for slot in slots:
                self._in_progress[slot] = self._in_progress.get(slot, 0) + 1
        turn = Turn(self, user, slots)
        if conversation_id is not None:
            try:
                turn.hold(conversation_id)
            except BaseException:
                turn.release()
                raise
        return turn

    def busy(self, user: str, conversation_id: int | None) -> bool:
        with self._lock:
            return (user, conversation_id) in self._replying

    def in_progress(self, user: str) -> int:
        """The user's replies in progress now."""
        with self._lock:
            return self._in_progress.get(("user", user), 0)

    def wait(self, user: str, conversation_id: int | None, timeout: float) -> None:
        """Until the conversation's reply (if any) has ended and been stored, or `timeout`."""
        with self._lock:
            ended = self._replying.get((user, conversation_id))
        if ended is not None:
            ended.wait(timeout=timeout)

    def _take(self, user: str, conversation_id: int) -> None:
        with self._lock:
            if (user, conversation_id) in self._replying:
                raise ChatInputError(BUSY)
            self._replying[(user, conversation_id)] = threading.Event()

    def _release(self, user: str, conversation_id: int) -> None:
        with self._lock:
            ended = self._replying.pop((user, conversation_id))
        ended.set()

    def _free_slots(self, slots: list[tuple[str, str]]) -> None:
        with self._lock:
            for slot in slots:
                left = self._in_progress[slot] - 1
                if left:
                    self._in_progress[slot] = left
                else:
                    del self._in_progress[slot]


class ReplyViews(AsyncIterator[ChatView]):
    """A reply's views, holding its turn until they end. The views' generator releases the turn
    in its `finally` however it ends once started; but closing a generator that never started
    runs no `finally` (Stop before the first view), so `aclose()` releases it too, and so does
    garbage collection of an iterator that was dropped unstarted."""

    def __init__(self, views: AsyncIterator[ChatView], turn: Turn) -> None:
        self._views = views
        self._release = weakref.finalize(self, turn.release)  # runs once: here, or on collection

    async def __anext__(self) -> ChatView:
        with found():  # the conversation deleted meanwhile
            return await anext(self._views)

    async def aclose(self) -> None:
        try:
            await self._views.aclose()
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
        # (user, conversation) -> the key its reply in progress goes by, when not `chat<id>`.
        self._live: dict[tuple[str, int], str] = {}
        self._live_lock = threading.Lock()

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
        with self._live_lock:
            live = self._live.get((user, conversation_id))
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

    async def continue_with_summary(self, user: str, conversation_id: int | None, sliders: Sliders,
                                    origin: Origin = ANYWHERE) -> int:
        """A new chat that carries this one on: the model summarizes it (not stored here), and the
        summary joins the system prompt of the new chat, which is returned (its id) empty and
        ready for the next message. Refused while this chat has a reply in progress."""
        conversation_id = checked_id(conversation_id)
        if conversation_id is None:
            raise ChatInputError("Open a chat to continue it.")
        sampling = checked_sampling((sliders[0], sliders[1], SUMMARY_TOKENS))
        turn = self._turns.start(user, conversation_id, origin)
        try:
            with found():
                conversation = await asyncio.to_thread(self.store.conversation, user, conversation_id)
                rows = await asyncio.to_thread(self._rows, user, conversation_id)
            if not rows:
                raise ChatInputError("This chat has nothing to summarize yet.")
            request = rows + [{"role": "user", "content": SUMMARY_REQUEST}]
            try:
                reply = await self._start_fitted(conversation["system_prompt"], request, sampling, conversation_id,
                                                 user, fit=True)
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
        finally:
            turn.release()

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
        size = os.path.getsize(path)
        if size > MAX_IMPORT_BYTES:
            raise ChatInputError(f"The file is {size:,} bytes; a chat to import is at most {MAX_IMPORT_BYTES:,}.")
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
            return self._reply(turn, user, conversation_id, system_prompt, rows, sampling,
                               functools.partial(self._store_message, user, conversation_id, text, system_prompt),
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
            return self._reply(turn, user, conversation_id, self._system_prompt(user, conversation_id),
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

            return self._reply(turn, user, conversation_id, self._system_prompt(user, conversation_id),
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

    def _reply(self, turn: Turn, user: str, conversation_id: int | None, system_prompt: str, rows: list[dict],
               sampling: SamplingParams, before: Callable[[], int] | None, save: SaveReply) -> ReplyViews:
        """The reply flow, holding `turn` until the reply has ended and been stored."""
        return ReplyViews(self._views(turn, user, conversation_id, system_prompt, rows, sampling, before, save), turn)

    async def _views(self, turn: Turn, user: str, conversation_id: int | None, system_prompt: str,
                     rows: list[dict], sampling: SamplingParams, before: Callable[[], int] | None,
                     save: SaveReply) -> AsyncIterator[ChatView]:
        """Submit `rows` (the refusal view, storing nothing, if the engine will not take them);
        then `before()` stores the user's side and names the conversation, and that view is
        shown; then the reply streams and `save` stores it with its numbers. Store calls run on
        worker threads: SQLite may wait for a lock, and the event loop must not."""
        try:
            shown = render.chat_messages(rows)
            fit = conversation_id is not None and await asyncio.to_thread(self._fits_context, user, conversation_id)
            try:
                reply = await self._start_fitted(system_prompt, rows, sampling, conversation_id, user, fit)
            except ValueError as error:
                yield ChatView(shown + [render.error_message(refusal(error))], conversation_id, refused=True)
                return
            except EngineBusyError:
                yield ChatView(shown + [render.error_message(BUSY_ENGINE)], conversation_id, refused=True)
                return
            except BackendError as error:
                yield ChatView(shown + [render.error_message(f"{error}. Nothing was sent; try again in a moment.")],
                               conversation_id, refused=True)
                return
            try:  # the request is aborted however this generator ends, even before streaming
                if before is not None:
                    created = conversation_id is None
                    try:
                        conversation_id = await asyncio.to_thread(before)
                    except NotFound:
                        raise
                    except Exception:  # the store failed: nothing was written (one transaction)
                        log.exception("could not store the user's message")
                        yield ChatView(shown + [render.error_message(UNSAVED_MESSAGE)], conversation_id, refused=True)
                        return
                    if created:
                        turn.hold(conversation_id)
                        with self._live_lock:  # its requests go by `chat-new-…` (see `memory`)
                            self._live[(user, conversation_id)] = reply.request_id.split("/", 1)[0]
                    yield ChatView(shown, conversation_id)
                saved = functools.partial(asyncio.to_thread, save, user, conversation_id)
                # Closed with this generator: unlike `yield from`, `async for` would leave it open.
                async with aclosing(self._stream(reply, shown, user, conversation_id, saved)) as views:
                    async for view in views:
                        yield view
            finally:
                await reply.aclose()
        finally:
            with self._live_lock:
                self._live.pop((user, conversation_id), None)
            turn.release()

    async def _stream(self, reply: ReplyStream, shown: list[dict], user: str, conversation_id: int,
                      save: Callable[[str, dict], Awaitable[dict]]) -> AsyncIterator[ChatView]:
        """Show the reply as it grows, then store it with its numbers. Closing this generator or
        cancelling its reader aborts the engine request and stores the partial reply as stopped."""
        completed = False
        try:
            async with aclosing(paced(reply, VIEW_INTERVAL_S)) as states:
                async for _ in states:
                    live = {"role": "assistant", "content": reply.text or "…"}
                    yield ChatView(shown + [render.chat_message(live)], conversation_id)
            completed = True
        finally:
            await reply.aclose()
            if not completed:
                if reply.text.strip():  # never mask the close: a store failure is logged, the app goes on
                    await kept(save, reply.text, {**reply.metrics(), "finish_reason": "abort", "stopped": True})
        if reply.finish_reason == "error" or (reply.finish_reason == "abort" and not reply.text):
            problem = reply.error or "the engine ended this reply early"
            if reply.text.strip():
                await kept(save, reply.text, reply.metrics())  # the error below says enough if this fails
            yield ChatView(shown + [render.error_message(f"The engine could not finish this reply: {problem}. "
                                                         "Try again or start a new chat.")], conversation_id)
            return
        if not reply.text.strip():
            yield ChatView(shown + [render.error_message("The model returned an empty reply.")], conversation_id)
            return
        metrics = reply.metrics()
        if reply.finish_reason == "abort":
            metrics.update(finish_reason="abort", stopped=True)
        stored = await kept(save, reply.text, metrics)
        if stored is None:  # show the text the user has read, and say it is not kept
            yield ChatView(shown + [render.chat_message({"role": "assistant", "content": reply.text}),
                                    render.error_message(UNSAVED_REPLY)], conversation_id)
            return
        yield ChatView(await self._stored_view(shown, stored, user, conversation_id), conversation_id)

    async def _stored_view(self, shown: list[dict], stored: dict, user: str, conversation_id: int) -> list[dict]:
        """The chat once the reply is stored, re-read so that every message carries its versions
        (a regenerated reply is now 3/3); the reply added to what was shown if that read fails."""
        try:
            return render.chat_messages(await asyncio.to_thread(self._rows, user, conversation_id))
        except NotFound:
            raise
        except Exception:
            log.exception("could not read the chat back after storing a reply")
            return shown + [render.chat_message(stored)]

    def _add_reply(self, user: str, conversation_id: int, text: str, metrics: dict) -> dict:
        return self.store.add_message(user, conversation_id, "assistant", text, **metrics)

    def _replace_reply(self, user: str, conversation_id: int, text: str, metrics: dict) -> dict:
        return self.store.replace_last_assistant(user, conversation_id, text, **metrics)

    def _rows(self, user: str, conversation_id: int | None) -> list[dict]:
        return self.store.messages(user, conversation_id) if conversation_id else []

    async def _start_fitted(self, system_prompt: str, rows: list[dict], sampling: SamplingParams,
                            conversation_id: int | None, user: str, fit: bool) -> ReplyStream:
        """The reply started on `rows`; with `fit`, a prompt the backend finds too long loses
        its oldest turn and is offered again, down to the last user message alone (the reply
        records how many messages were left out). Raises as `start_reply` does."""
        left_out = 0
        while True:
            try:
                reply = await start_reply(self.backend, prompt_of(system_prompt, rows[left_out:]), sampling,
                                          conversation_id, user, previous_backend(rows))
            except ValueError:
                later = next_turn(rows, left_out) if fit else None
                if later is None:
                    raise
                left_out = later
                continue
            reply.left_out = left_out
            return reply

    def _fits_context(self, user: str, conversation_id: int) -> bool:
        return bool(self.store.conversation(user, conversation_id)["fit_context"])

    def _system_prompt(self, user: str, conversation_id: int) -> str:
        return self.store.conversation(user, conversation_id)["system_prompt"]


async def kept(save: Callable[[str, dict], Awaitable[dict]], text: str, metrics: dict) -> dict | None:
    """The stored reply, or None if the store failed (logged). A conversation deleted meanwhile
    still raises NotFound: the user is told it is gone."""
    try:
        return await save(text, metrics)
    except NotFound:
        raise
    except Exception:
        log.exception("could not store a reply")
        return None


def last_user_index(rows: list[dict]) -> int | None:
    """Where the last user message stands in `rows`, or None."""
    return max((i for i, m in enumerate(rows) if m["role"] == "user"), default=None)


def next_turn(rows: list[dict], start: int) -> int | None:
    """Where the turn after the one at `start` begins (its user message), if the prompt would
    still end with the chat's last user message; else None (nothing more may be left out)."""
    last = last_user_index(rows)
    return next((i for i in range(start + 1, len(rows)) if rows[i]["role"] == "user" and i <= (last or 0)), None)


def last_user_message(rows: list[dict]) -> str:
    index = last_user_index(rows)
    return rows[index]["content"] if index is not None else ""


def previous_backend(rows: list[dict]) -> str | None:
    """The backend that wrote the conversation's latest reply, if a remote one did."""
    return next((m.get("backend") for m in reversed(rows) if m["role"] == "assistant"), None)


def prompt_of(system_prompt: str, rows: list[dict]) -> list[dict]:
    """The messages the engine sees: the system prompt (if any), then the rows."""
    head = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    return head + [{"role": m["role"], "content": m["content"]} for m in rows]


def checked_id(conversation_id: object) -> int | None:
    """A conversation id as the page or an API caller gives it: None (no chat open yet) or a
    whole number. One that no row can have reads as any missing conversation does."""
    if conversation_id is None:
        return None
    if isinstance(conversation_id, bool) or not isinstance(conversation_id, (int, float)) \
            or (isinstance(conversation_id, float) and not conversation_id.is_integer()):
        raise ChatInputError(f"A conversation id is a whole number, not {conversation_id!r}.")
    if not 1 <= conversation_id <= MAX_CONVERSATION_ID:
        raise ChatInputError(NOT_YOURS)
    return int(conversation_id)


def checked_text(value: object, what: str) -> str:
    """Text from the page or an API caller; None reads as "". Text that is not valid Unicode
    (a lone surrogate, which JSON can carry) could be neither tokenized nor stored."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ChatInputError(f"The {what} must be text.")
    if len(value) > MAX_TEXT_CHARS:
        raise ChatInputError(f"The {what} is {len(value):,} characters long; the limit is {MAX_TEXT_CHARS:,}. "
                             "Shorten it and try again.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ChatInputError(f"The {what} has characters that are not valid text (lone surrogates): "
                             "remove them and try again.") from None
    return value


def checked_sampling(sliders: Sliders) -> SamplingParams:
    try:
        return params.sampling_params(*sliders)
    except ValueError as error:
        raise ChatInputError(str(error)) from None


def refusal(error: ValueError) -> str:
    return (f"This conversation is too long for the model's memory ({error}). "
            "Start a new chat or send a shorter message.")
