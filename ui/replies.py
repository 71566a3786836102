"""One reply, from the prompt submitted to the reply stored: what the chatbot shows as it
streams (`ChatView`s), and what is stored when it ends, is stopped or fails.

A reply is an async iterator of `ChatView`s (`ReplyViews`): the page shows each as it comes, and
waiting for the next token holds no thread. It runs on the event loop; its store calls run on
worker threads (SQLite may wait for a lock, and the event loop must not). Closing it mid-reply,
or cancelling the task that reads it (the Stop button, a browser gone), aborts the engine request
and stores the partial reply as stopped. It holds its conversation's turn (ui/turns.py) until it
has ended and been stored.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import NamedTuple

from engine import EngineBusyError, SamplingParams
from storage import NotFound, Store
from ui import render
from ui.backends.backend import BackendError, ChatBackend
from ui.chat_input import found
from ui.stream import ReplyStream, paced, start_reply
from ui.turns import Turn

log = logging.getLogger(__name__)

# A streaming reply is redrawn at most this often: each redraw costs the page (Gradio's
# postprocessing and diff of the whole chat) far more than a token, and that CPU time comes out of
# the engine's own compute threads on a small machine; ~10 redraws a second still read as smooth.
VIEW_INTERVAL_S = 0.1
UNSAVED_MESSAGE = "Your message could not be saved (a storage error): nothing was sent. Try again in a moment."
UNSAVED_REPLY = ("This reply could not be saved (a storage error): it is shown here, but it will not be in "
                 "the chat when you open it again. Copy what you need, or regenerate it.")
BUSY_ENGINE = "The server is busy with other chats right now: nothing was sent. Try again in a moment."

# Stores a finished or stopped reply: (user, conversation id, text, metrics) -> the stored row.
SaveReply = Callable[[str, int, str, dict], dict]


class ChatView(NamedTuple):
    """The chat as the chatbot shows it now, and the conversation it belongs to (None until the
    first reply creates it). `refused`: the engine would not take the prompt; nothing was stored."""
    messages: list[dict]
    conversation_id: int | None
    refused: bool = False


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


class Replies:
    """The reply flow around one backend and one store, shared by all sessions; it also knows
    the key each reply in progress goes by (a new chat's first reply has its own)."""

    def __init__(self, backend: ChatBackend, store: Store) -> None:
        self.backend = backend
        self.store = store
        # (user, conversation) -> the key its reply in progress goes by, when not `chat<id>`.
        self._live: dict[tuple[str, int], str] = {}
        self._live_lock = threading.Lock()

    def live_key(self, user: str, conversation_id: int) -> str | None:
        """The key the conversation's reply in progress goes by, if not `chat<id>`."""
        with self._live_lock:
            return self._live.get((user, conversation_id))

    def views(self, turn: Turn, user: str, conversation_id: int | None, system_prompt: str, rows: list[dict],
              sampling: SamplingParams, before: Callable[[], int] | None, save: SaveReply) -> ReplyViews:
        """The reply to `rows`, holding `turn` until the reply has ended and been stored. Nothing
        is submitted or stored until the views are iterated."""
        return ReplyViews(self._views(turn, user, conversation_id, system_prompt, rows, sampling, before, save), turn)

    async def _views(self, turn: Turn, user: str, conversation_id: int | None, system_prompt: str,
                     rows: list[dict], sampling: SamplingParams, before: Callable[[], int] | None,
                     save: SaveReply) -> AsyncIterator[ChatView]:
        """Submit `rows` (the refusal view, storing nothing, if the engine will not take them);
        then `before()` stores the user's side and names the conversation, and that view is
        shown; then the reply streams and `save` stores it with its numbers."""
        try:
            shown = render.chat_messages(rows)
            fit = conversation_id is not None and await asyncio.to_thread(self._fits_context, user, conversation_id)
            try:
                reply = await self.start_fitted(system_prompt, rows, sampling, conversation_id, user, fit)
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
            # Closed however this generator ends, even before streaming: a remote reply's connection and
            # the router's count of it end only then (the engine's client aborts a dropped one by itself).
            try:
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
                        with self._live_lock:  # its requests go by `chat-new-…` (see `live_key`)
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

    async def start_fitted(self, system_prompt: str, rows: list[dict], sampling: SamplingParams,
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

    def _rows(self, user: str, conversation_id: int | None) -> list[dict]:
        return self.store.messages(user, conversation_id) if conversation_id else []


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


def refusal(error: ValueError) -> str:
    return (f"This conversation is too long for the model's memory ({error}). "
            "Start a new chat or send a shorter message.")
