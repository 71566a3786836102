"""The chat page's handlers, each named after its event (`on_send`, `on_stop`'s `on_stopped`,
`on_export`, ...) and wired in ui/chat.py: a handler resolves the user, asks the `ChatController`
(the page's logic, no Gradio) and shows its `ChatInputError`s as Gradio errors.

The controller's methods are synchronous (ui/conversation.py). Most handlers are too: Gradio
runs them on its worker threads. A reply's handlers are async generators, so that a reply waiting
for its next token holds no thread and Stop or a closed tab cancels it at once; they, and
`on_continue`, call the controller through `asyncio.to_thread`, then drive what it hands back
(a reply's views, a summary) on the event loop.
"""
from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, aclosing, contextmanager, nullcontext

import gradio as gr

from ui import chat_memory, context_meter, identity, presets
from ui.chat_input import ChatInputError, checked_id
from ui.conversation import ChatController
from ui.replies import ChatView, ReplyViews
from ui.sessions import Sessions, until_gone


@contextmanager
def shown_to_user() -> Iterator[None]:
    """A `ChatInputError` becomes a `gr.Error`: the page shows its text in a toast."""
    try:
        yield
    except ChatInputError as error:
        raise gr.Error(str(error)) from None


async def relay(views: ReplyViews, outputs: Callable[[ChatView], tuple],
                gone: AbstractContextManager[asyncio.Event | None]) -> AsyncIterator[tuple]:
    """The controller's views as an event's outputs, until they end or the browser is gone
    (`gone` holds the session's event while the reply is relayed). Stop cancels the event;
    either way the reply being written is cancelled at once: the engine request is aborted and
    the partial reply stored as stopped."""
    try:
        with shown_to_user(), gone as left:
            async with aclosing(until_gone(views, left)) as shown:
                async for view in shown:
                    yield outputs(view)
    finally:
        await views.aclose()


def reply_controls(replying: bool) -> tuple[gr.Button, ...]:
    """Send, Regenerate and Resend, then Stop: only Stop while a reply is being written."""
    return (*(gr.Button(interactive=not replying) for _ in range(3)), gr.Button(interactive=replying))


def chat_and_id(view: ChatView) -> tuple:
    """The outputs of Regenerate and Resend: the chatbot and the conversation id."""
    return view.messages, view.conversation_id


class ChatEvents:
    """The handlers of one chat page, around its controller. With `sessions` (watched by the
    server's middleware), a reply whose browser disconnects is cancelled at once. `exported`:
    the file list that exports are handed to (Gradio deletes them on that component's schedule)."""

    def __init__(self, chat: ChatController, sessions: Sessions | None, exported: gr.File) -> None:
        self.chat = chat
        self.sessions = sessions
        self.exported = exported

    def _gone(self, request: gr.Request | None) -> AbstractContextManager[asyncio.Event | None]:
        session = request.session_hash if request is not None else None
        return self.sessions.watch(session) if self.sessions is not None and session else nullcontext()

    def _conversation_list(self, user: str, selected: int | None, query: str = "") -> gr.Radio:
        with shown_to_user():
            return gr.Radio(choices=self.chat.conversation_choices(user, query), value=checked_id(selected))

    def on_load(self, stored_id: str | None, profile: gr.OAuthProfile | None = None):
        browser_id = stored_id if identity.is_anonymous_id(stored_id) else identity.new_anonymous_id()
        user = identity.resolve_user(browser_id, profile)
        if user != browser_id:
            self.chat.adopt_anonymous(browser_id, user)
        return browser_id, user, self._conversation_list(user, None)

    # ---- a turn: its reply streams, then the page settles ------------------------------------
    async def on_send(self, user_id: str, conversation_id: int | None, message: str, preset: str, custom: str,
                      temperature: float, top_p: float, max_tokens: float, request: gr.Request,
                      profile: gr.OAuthProfile | None = None) -> AsyncIterator[tuple]:
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            views = await asyncio.to_thread(self.chat.send, user, conversation_id, message,
                                            presets.system_prompt(preset, custom), (temperature, top_p, max_tokens),
                                            identity.origin_of(request))
        # The box is set once, by the first view: emptied, or a refused message left in it to be
        # shortened. Later views leave it alone, so the next message can be typed while this reply
        # streams (each view, and the event's completion, would otherwise empty it again).
        first = True

        def outputs(view: ChatView) -> tuple:
            nonlocal first
            if not first:
                return (*chat_and_id(view), gr.skip())
            first = False
            return (*chat_and_id(view), message if view.refused else "")

        async for shown in relay(views, outputs, self._gone(request)):
            yield shown

    async def on_regenerate(self, user_id: str, conversation_id: int | None, temperature: float, top_p: float,
                            max_tokens: float, request: gr.Request,
                            profile: gr.OAuthProfile | None = None) -> AsyncIterator[tuple]:
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            views = await asyncio.to_thread(self.chat.regenerate, user, conversation_id,
                                            (temperature, top_p, max_tokens), identity.origin_of(request))
        async for outputs in relay(views, chat_and_id, self._gone(request)):
            yield outputs

    async def on_edit(self, user_id: str, conversation_id: int | None, edited: str, temperature: float,
                      top_p: float, max_tokens: float, request: gr.Request,
                      profile: gr.OAuthProfile | None = None) -> AsyncIterator[tuple]:
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            views = await asyncio.to_thread(self.chat.edit_last, user, conversation_id, edited,
                                            (temperature, top_p, max_tokens), identity.origin_of(request))
        async for outputs in relay(views, chat_and_id, self._gone(request)):
            yield outputs

    async def on_edit_message(self, user_id: str, conversation_id: int | None, temperature: float, top_p: float,
                              max_tokens: float, edit: gr.EditData, request: gr.Request,
                              profile: gr.OAuthProfile | None = None) -> AsyncIterator[tuple]:
        """The chatbot's own edit (the pencil on any of the user's messages): fork there."""
        user = identity.resolve_user(user_id, profile)
        index = edit.index if isinstance(edit.index, int) else None
        with shown_to_user():
            views = await asyncio.to_thread(self.chat.edit_message, user, conversation_id, index, edit.value,
                                            (temperature, top_p, max_tokens), origin=identity.origin_of(request))
        async for outputs in relay(views, chat_and_id, self._gone(request)):
            yield outputs

    def on_turn_start(self):
        return *reply_controls(True), gr.Timer(active=True)

    def on_turn_end(self, user_id: str, conversation_id: int | None, query: str,
                    profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            return (self._conversation_list(user, conversation_id, query),
                    self.chat.last_user_message(user, conversation_id))

    def on_settle(self, user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None):
        """After a turn (or a refused one, or Stop): the controls as the server sees the chat,
        so a turn refused while another streams leaves them as that one needs them."""
        replying = self.chat.replying(identity.resolve_user(user_id, profile), conversation_id)
        return *reply_controls(replying), gr.Timer(active=replying)

    def on_stopped(self, user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None):
        """After Stop: the chat redrawn from the store once the stopped reply is in it."""
        with shown_to_user():
            return self.chat.after_stop(identity.resolve_user(user_id, profile), conversation_id)

    def on_show_version(self, user_id: str, conversation_id: int | None, asked: str,
                        profile: gr.OAuthProfile | None = None):
        """A `‹ ›` click: the box holds "<message id>:<time>" (ui/page_script.py)."""
        message_id = (asked or "").partition(":")[0]
        if not message_id:
            return gr.Chatbot(), gr.Textbox()
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            messages = self.chat.show_version(user, conversation_id, message_id)
            return messages, self.chat.last_user_message(user, conversation_id)

    # ---- the sidebar ----------------------------------------------------------------------------
    def on_new_chat(self):
        return [], None, "", "", gr.Radio(value=None)

    def on_select(self, user_id: str, selected: int | None, profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        if selected is None:
            return [], None, gr.Dropdown(), gr.Textbox(), "", ""
        with shown_to_user():
            opened = self.chat.open_chat(user, selected)
        return opened.messages, selected, opened.preset, opened.custom, opened.title, opened.last_user_message

    def on_search(self, user_id: str, query: str, conversation_id: int | None,
                  profile: gr.OAuthProfile | None = None):
        return self._conversation_list(identity.resolve_user(user_id, profile), conversation_id, query)

    def on_rename(self, user_id: str, conversation_id: int | None, title: str, query: str,
                  profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            self.chat.rename(user, conversation_id, title)
        return self._conversation_list(user, conversation_id, query)

    def on_delete_ask(self, conversation_id: int | None):
        with shown_to_user():
            self.chat.check_deletable(conversation_id)
        return gr.Row(visible=True)

    def on_delete_confirm(self, user_id: str, conversation_id: int | None, query: str,
                          profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            self.chat.delete(user, conversation_id)
        return [], None, "", self._conversation_list(user, None, query), gr.Row(visible=False)

    def on_delete_cancel(self):
        return gr.Row(visible=False)

    def on_export(self, user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        # The files are handed to Gradio's cache (which serves them and deletes them on its
        # schedule, ui/chat.py's TEMP_FILES_KEPT_S) here, so that the folder they were written in
        # goes at once.
        with shown_to_user(), tempfile.TemporaryDirectory(prefix="pagedchat-export-") as folder:
            files = [self.exported.move_resource_to_block_cache(path)
                     for path in self.chat.export(user, conversation_id, folder)]
        return gr.File(value=files, visible=True)

    def on_import(self, user_id: str, upload: str | None, query: str, profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        if not upload:
            raise gr.Error("Choose an exported chat (a .json file) to import.")
        with shown_to_user():
            conversation_id = self.chat.import_file(user, upload)
            opened = self.chat.open_chat(user, conversation_id)
        return (opened.messages, conversation_id, opened.preset, opened.custom, opened.title,
                opened.last_user_message, self._conversation_list(user, conversation_id, query))

    def on_delete_all_ask(self):
        return gr.Column(visible=True)

    def on_delete_all_cancel(self):
        return gr.Column(visible=False)

    def on_delete_all_confirm(self, user_id: str, profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            deleted = self.chat.delete_all(user)
        gr.Info(f"Deleted {deleted} chat{'s' if deleted != 1 else ''}.")
        return [], None, "", "", self._conversation_list(user, None), gr.Row(visible=False)

    # ---- the context meter, the memory strip, and what to do when the chat is full -----------------
    def on_meter(self, user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None):
        """The model and context line, the offers once the chat is nearly full, and the strip."""
        user = identity.resolve_user(user_id, profile)
        try:
            use, fit = self.chat.context(user, conversation_id)
        except ChatInputError:  # a chat deleted meanwhile: show the empty line
            conversation_id = None
            use, fit = self.chat.context(user, None)
        return (context_meter.meter_html(use), gr.Row(visible=use.near_limit or fit), gr.Checkbox(value=fit),
                self.on_memory(user_id, conversation_id, profile))

    def on_memory(self, user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None) -> str:
        user = identity.resolve_user(user_id, profile)
        try:
            memory, key = self.chat.memory(user, conversation_id)
        except ChatInputError:
            return chat_memory.strip_html(None, None)
        return chat_memory.strip_html(memory, key)

    def on_fit(self, user_id: str, conversation_id: int | None, on: bool, profile: gr.OAuthProfile | None = None):
        with shown_to_user():
            self.chat.set_fit_context(identity.resolve_user(user_id, profile), conversation_id, on)
        gr.Info("This chat now leaves out its oldest turns when the next one would not fit." if on else
                "This chat now refuses a turn that would not fit, and says so.")

    async def on_continue(self, user_id: str, conversation_id: int | None, temperature: float, top_p: float,
                          max_tokens: float, query: str, request: gr.Request,
                          profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            continuation = await asyncio.to_thread(self.chat.continue_with_summary, user, conversation_id,
                                                   (temperature, top_p, max_tokens), identity.origin_of(request))
            new_id = await continuation.new_chat()
            opened = await asyncio.to_thread(self.chat.open_chat, user, new_id)
        gr.Info("A new chat carries a summary of the old one in its system prompt (under the parameters).")
        return (opened.messages, new_id, opened.preset, opened.custom, opened.title, opened.last_user_message,
                self._conversation_list(user, new_id, query))

    # ---- the parameters -------------------------------------------------------------------------
    def on_preset_change(self, preset: str):
        return gr.Textbox(visible=preset == presets.CUSTOM)
