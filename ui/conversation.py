"""What the chat page does, without Gradio: the sidebar list, opening, renaming and deleting a
chat, and the reply flow behind Send, Regenerate and Resend edited message.

Every method names the user; every store call passes it on, so another user's conversation is
`storage.NotFound`. A user's mistake raises `ChatInputError`, whose text the page shows as is.
A reply is a generator of `ChatView`s: the page shows each as it comes. Closing the generator
mid-reply (the Stop button) aborts the engine request and stores the partial reply as stopped.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import NamedTuple

from engine import EngineClient, SamplingParams
from storage import NotFound, Store
from ui import params, presets, render
from ui.stream import ReplyStream, start_reply

log = logging.getLogger(__name__)

TITLE_CHARS = 48
STOP_WAIT_S = 5.0

# (temperature, top_p, max new tokens) as the sliders give them; checked by the controller.
Sliders = tuple[float, float, float]
# Stores a finished or stopped reply: (user, conversation id, text, metrics) -> the stored row.
SaveReply = Callable[[str, int, str, dict], dict]


class ChatInputError(ValueError):
    """Something the user must change before the page can act; its text is shown to them."""


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


class ChatController:
    """The chat page's logic around one engine client and one store, shared by all sessions."""

    def __init__(self, client: EngineClient, store: Store) -> None:
        self.client = client
        self.store = store
        # Stop closes a reply's generator, which then stores the partial reply on the thread that
        # ran it; `after_stop` waits for that before redrawing. Keyed by conversation id.
        self._streams_ending: dict[int, threading.Event] = {}

    # ---- the sidebar and the open chat --------------------------------------------------------
    def conversation_choices(self, user: str, query: str = "") -> list[tuple[str, int]]:
        """(label, id) for each of the user's chats, or for the search hits when `query` is set."""
        if query.strip():
            return [(f"{c['title']} — {c['snippet']}", c["id"]) for c in self.store.search(user, query)]
        return [(c["title"], c["id"]) for c in self.store.conversations(user)]

    def open_chat(self, user: str, conversation_id: int) -> OpenedChat:
        try:
            conversation = self.store.conversation(user, conversation_id)
        except NotFound:
            raise ChatInputError("That conversation no longer exists.") from None
        rows = self.store.messages(user, conversation_id)
        preset, custom = presets.preset_for(conversation["system_prompt"])
        return OpenedChat(render.chat_messages(rows), preset, custom, conversation["title"], last_user_message(rows))

    def last_user_message(self, user: str, conversation_id: int | None) -> str:
        """What "Edit your last message" starts from: the user's last message, or ""."""
        return last_user_message(self._rows(user, conversation_id))

    def rename(self, user: str, conversation_id: int | None, title: str) -> None:
        if conversation_id is None or not (title or "").strip():
            raise ChatInputError("Open a chat and type its new title first.")
        self.store.rename(user, conversation_id, title)

    def check_deletable(self, conversation_id: int | None) -> None:
        if conversation_id is None:
            raise ChatInputError("Open a chat to delete it.")

    def delete(self, user: str, conversation_id: int | None) -> None:
        if conversation_id is not None:
            self.store.delete_conversation(user, conversation_id)

    def after_stop(self, user: str, conversation_id: int | None, timeout: float = STOP_WAIT_S) -> list[dict]:
        """After Stop: wait (briefly) for the stopped reply to be stored, then the chat as stored,
        so the reply carries its "stopped" mark."""
        ending = self._streams_ending.get(conversation_id) if conversation_id is not None else None
        if ending is not None:
            ending.wait(timeout=timeout)
        return render.chat_messages(self._rows(user, conversation_id))

    # ---- replies: each says what differs, `_reply` does the rest -------------------------------
    def send(self, user: str, conversation_id: int | None, message: str, system_prompt: str,
             sliders: Sliders) -> Iterator[ChatView]:
        """A new user message and its reply; the first one creates the conversation, titled
        from the message. A prompt the engine refuses stores nothing."""
        text = (message or "").strip()
        if not text:
            raise ChatInputError("Type a message first.")
        sampling = checked_sampling(sliders)
        rows = self._rows(user, conversation_id) + [{"role": "user", "content": text}]

        def store_message() -> int:
            chat_id = conversation_id
            if chat_id is None:
                chat_id = self.store.create_conversation(user, title=text[:TITLE_CHARS],
                                                         system_prompt=system_prompt)["id"]
            elif self.store.conversation(user, chat_id)["system_prompt"] != system_prompt:
                self.store.set_system_prompt(user, chat_id, system_prompt)
            self.store.add_message(user, chat_id, "user", text)
            return chat_id

        return self._reply(user, conversation_id, system_prompt, rows, sampling, store_message, self._add_reply)

    def regenerate(self, user: str, conversation_id: int | None, sliders: Sliders) -> Iterator[ChatView]:
        """A new reply in place of the last one (or a reply to a last message that has none)."""
        rows = self._rows(user, conversation_id)
        if not rows:
            raise ChatInputError("Nothing to regenerate yet.")
        replacing = rows[-1]["role"] == "assistant"
        sampling = checked_sampling(sliders)
        return self._reply(user, conversation_id, self._system_prompt(user, conversation_id),
                           rows[:-1] if replacing else rows, sampling, None,
                           self._replace_reply if replacing else self._add_reply)

    def edit_last(self, user: str, conversation_id: int | None, edited: str, sliders: Sliders) -> Iterator[ChatView]:
        """The user's last message replaced by `edited`, its reply dropped, and a new reply."""
        text = (edited or "").strip()
        rows = self._rows(user, conversation_id)
        last_user = last_user_index(rows)
        if not text or last_user is None:
            raise ChatInputError("There is no sent message to edit, or the edit is empty.")
        sampling = checked_sampling(sliders)

        def store_edit() -> int:
            self.store.edit_last_user_message(user, conversation_id, text)
            return conversation_id

        return self._reply(user, conversation_id, self._system_prompt(user, conversation_id),
                           rows[:last_user] + [{"role": "user", "content": text}], sampling, store_edit,
                           self._add_reply)

    def _reply(self, user: str, conversation_id: int | None, system_prompt: str, rows: list[dict],
               sampling: SamplingParams, before: Callable[[], int] | None, save: SaveReply) -> Iterator[ChatView]:
        """The reply flow: submit `rows` (the refusal view, storing nothing, if the engine will not
        take them); then `before()` stores the user's side and names the conversation, and that
        view is shown; then the reply streams and `save` stores it with its numbers."""
        shown = render.chat_messages(rows)
        try:
            reply = start_reply(self.client, prompt_of(system_prompt, rows), sampling, conversation_id)
        except ValueError as error:
            yield ChatView(shown + [render.error_message(refusal(error))], conversation_id, refused=True)
            return
        with closing(reply):  # aborts the request however this generator ends, even before streaming
            if before is not None:
                conversation_id = before()
                yield ChatView(shown, conversation_id)
            yield from self._stream(reply, shown, conversation_id, functools.partial(save, user, conversation_id))

    def _stream(self, reply: ReplyStream, shown: list[dict], conversation_id: int,
                save: Callable[[str, dict], dict]) -> Iterator[ChatView]:
        """Show the reply as it grows, then store it with its numbers. Closing this generator
        aborts the engine request and stores the partial reply as stopped."""
        completed = False
        ended = self._streams_ending[conversation_id] = threading.Event()
        try:
            for _ in reply:
                live = {"role": "assistant", "content": reply.text or "…"}
                yield ChatView(shown + [render.chat_message(live)], conversation_id)
            completed = True
        finally:
            reply.close()
            if not completed:
                try:
                    if reply.text.strip():
                        save(reply.text, {**reply.metrics(), "finish_reason": "abort", "stopped": True})
                except Exception:  # never mask the close; the reply is lost, the app goes on
                    log.exception("could not store a stopped reply")
            ended.set()
            if completed and self._streams_ending.get(conversation_id) is ended:
                del self._streams_ending[conversation_id]
        if reply.finish_reason == "error" or (reply.finish_reason == "abort" and not reply.text):
            problem = reply.error or "the engine ended this reply early"
            if reply.text.strip():
                save(reply.text, reply.metrics())
            yield ChatView(shown + [render.error_message(f"The engine could not finish this reply: {problem}. "
                                                         "Try again or start a new chat.")], conversation_id)
            return
        if not reply.text.strip():
            yield ChatView(shown + [render.error_message("The model returned an empty reply.")], conversation_id)
            return
        metrics = reply.metrics()
        if reply.finish_reason == "abort":
            metrics.update(finish_reason="abort", stopped=True)
        yield ChatView(shown + [render.chat_message(save(reply.text, metrics))], conversation_id)

    def _add_reply(self, user: str, conversation_id: int, text: str, metrics: dict) -> dict:
        return self.store.add_message(user, conversation_id, "assistant", text, **metrics)

    def _replace_reply(self, user: str, conversation_id: int, text: str, metrics: dict) -> dict:
        return self.store.replace_last_assistant(user, conversation_id, text, **metrics)

    def _rows(self, user: str, conversation_id: int | None) -> list[dict]:
        return self.store.messages(user, conversation_id) if conversation_id else []

    def _system_prompt(self, user: str, conversation_id: int) -> str:
        return self.store.conversation(user, conversation_id)["system_prompt"]


def last_user_index(rows: list[dict]) -> int | None:
    """Where the last user message stands in `rows`, or None."""
    return max((i for i, m in enumerate(rows) if m["role"] == "user"), default=None)


def last_user_message(rows: list[dict]) -> str:
    index = last_user_index(rows)
    return rows[index]["content"] if index is not None else ""


def prompt_of(system_prompt: str, rows: list[dict]) -> list[dict]:
    """The messages the engine sees: the system prompt (if any), then the rows."""
    head = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    return head + [{"role": m["role"], "content": m["content"]} for m in rows]


def checked_sampling(sliders: Sliders) -> SamplingParams:
    try:
        return params.sampling_params(*sliders)
    except ValueError as error:
        raise ChatInputError(str(error)) from None


def refusal(error: ValueError) -> str:
    return (f"This conversation is too long for the model's memory ({error}). "
            "Start a new chat or send a shorter message.")
