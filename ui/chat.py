"""The chat page (Gradio): the layout, top to bottom, and small handlers named after their
events. Each handler resolves the user, asks the `ChatController` (the page's logic, no Gradio)
and shows its `ChatInputError`s as Gradio errors.

The user id travels as a hidden input filled from the browser's storage on load (an API caller
passes it explicitly); `identity.resolve_user` checks it, or takes the Space's OAuth profile.
"""
from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, aclosing, contextmanager, nullcontext

import gradio as gr

from ui.backends.backend import ChatBackend
from storage import Store
from ui import chat_memory, context_meter, identity, page_script, params, presets
from ui.space import on_space
from ui.chat_input import ChatInputError, checked_id
from ui.conversation import ChatController
from ui.replies import ChatView, ReplyViews
from ui.sessions import Sessions, until_gone

# A fixed key and secret keep the browser's id readable across server restarts; the id is
# the browser's own, so the encryption only guards against casual reading of localStorage.
BROWSER_KEY = "pagedchat-user"
BROWSER_SECRET = os.environ.get("PAGEDCHAT_BROWSER_SECRET", "pagedchat-browser-state")
STRIP_INTERVAL_S = 0.5  # the memory strip's refresh while a reply streams
# Gradio deletes the files it handed out (exports) or took in (uploads) after this long, and all
# of them when the server stops: otherwise its temporary folder only grows.
TEMP_FILES_KEPT_S = 3600
# Display maths first, so that `$$` is never read as two empty inline spans.
LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "\\[", "right": "\\]", "display": True},
         {"left": "$", "right": "$", "display": False}, {"left": "\\(", "right": "\\)", "display": False}]


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


def build_chat(backend: ChatBackend, store: Store, sessions: Sessions | None = None) -> gr.Blocks:
    """The chat page around one backend (whatever writes the replies) and one store. With
    `sessions` (watched by the server's middleware), a reply whose browser disconnects is
    cancelled at once."""
    chat = ChatController(backend, store)

    def gone(request: gr.Request | None) -> AbstractContextManager[asyncio.Event | None]:
        session = request.session_hash if request is not None else None
        return sessions.watch(session) if sessions is not None and session else nullcontext()

    def conversation_list(user: str, selected: int | None, query: str = "") -> gr.Radio:
        with shown_to_user():
            return gr.Radio(choices=chat.conversation_choices(user, query), value=checked_id(selected))

    # ---- handlers ---------------------------------------------------------------------------
    def on_load(stored_id: str | None, profile: gr.OAuthProfile | None = None):
        browser_id = stored_id if identity.is_anonymous_id(stored_id) else identity.new_anonymous_id()
        user = identity.resolve_user(browser_id, profile)
        if user != browser_id:
            chat.adopt_anonymous(browser_id, user)
        return browser_id, user, conversation_list(user, None)

    # A reply's handlers are async generators: a reply waiting for its next token holds no
    # thread, and Stop or a closed tab cancels it at once. The controller's checks and first
    # store reads run on a worker thread.
    async def on_send(user_id: str, conversation_id: int | None, message: str, preset: str, custom: str,
                      temperature: float, top_p: float, max_tokens: float, request: gr.Request,
                      profile: gr.OAuthProfile | None = None) -> AsyncIterator[tuple]:
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            views = await asyncio.to_thread(chat.send, user, conversation_id, message,
                                            presets.system_prompt(preset, custom), (temperature, top_p, max_tokens),
                                            identity.origin_of(request))
        # A refused message stays in the box, to be shortened.
        async for outputs in relay(views, lambda view: (*chat_and_id(view), message if view.refused else ""),
                                   gone(request)):
            yield outputs

    async def on_regenerate(user_id: str, conversation_id: int | None, temperature: float, top_p: float,
                            max_tokens: float, request: gr.Request,
                            profile: gr.OAuthProfile | None = None) -> AsyncIterator[tuple]:
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            views = await asyncio.to_thread(chat.regenerate, user, conversation_id, (temperature, top_p, max_tokens),
                                            identity.origin_of(request))
        async for outputs in relay(views, chat_and_id, gone(request)):
            yield outputs

    async def on_edit(user_id: str, conversation_id: int | None, edited: str, temperature: float, top_p: float,
                      max_tokens: float, request: gr.Request,
                      profile: gr.OAuthProfile | None = None) -> AsyncIterator[tuple]:
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            views = await asyncio.to_thread(chat.edit_last, user, conversation_id, edited,
                                            (temperature, top_p, max_tokens), identity.origin_of(request))
        async for outputs in relay(views, chat_and_id, gone(request)):
            yield outputs

    async def on_edit_message(user_id: str, conversation_id: int | None, temperature: float, top_p: float,
                              max_tokens: float, edit: gr.EditData, request: gr.Request,
                              profile: gr.OAuthProfile | None = None) -> AsyncIterator[tuple]:
        """The chatbot's own edit (the pencil on any of the user's messages): fork there."""
        user = identity.resolve_user(user_id, profile)
        index = edit.index if isinstance(edit.index, int) else None
        with shown_to_user():
            views = await asyncio.to_thread(chat.edit_message, user, conversation_id, index, edit.value,
                                            (temperature, top_p, max_tokens), origin=identity.origin_of(request))
        async for outputs in relay(views, chat_and_id, gone(request)):
            yield outputs

    def on_show_version(user_id: str, conversation_id: int | None, asked: str,
                        profile: gr.OAuthProfile | None = None):
        """A `‹ ›` click: the box holds "<message id>:<time>" (ui/page_script.py)."""
        message_id = (asked or "").partition(":")[0]
        if not message_id:
            return gr.Chatbot(), gr.Textbox()
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            messages = chat.show_version(user, conversation_id, message_id)
            return messages, chat.last_user_message(user, conversation_id)

    def on_turn_end(user_id: str, conversation_id: int | None, query: str,
                    profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            return conversation_list(user, conversation_id, query), chat.last_user_message(user, conversation_id)

    def on_turn_start():
        return *reply_controls(True), gr.Timer(active=True)

    def on_settle(user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None):
        """After a turn (or a refused one, or Stop): the controls as the server sees the chat,
        so a turn refused while another streams leaves them as that one needs them."""
        replying = chat.replying(identity.resolve_user(user_id, profile), conversation_id)
        return *reply_controls(replying), gr.Timer(active=replying)

    def on_stopped(user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None):
        """After Stop: the chat redrawn from the store once the stopped reply is in it."""
        with shown_to_user():
            return chat.after_stop(identity.resolve_user(user_id, profile), conversation_id)

    def on_new_chat():
        return [], None, "", "", gr.Radio(value=None)

    def on_select(user_id: str, selected: int | None, profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        if selected is None:
            return [], None, gr.Dropdown(), gr.Textbox(), "", ""
        with shown_to_user():
            opened = chat.open_chat(user, selected)
        return opened.messages, selected, opened.preset, opened.custom, opened.title, opened.last_user_message

    def on_search(user_id: str, query: str, conversation_id: int | None,
                  profile: gr.OAuthProfile | None = None):
        return conversation_list(identity.resolve_user(user_id, profile), conversation_id, query)

    def on_rename(user_id: str, conversation_id: int | None, title: str, query: str,
                  profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            chat.rename(user, conversation_id, title)
        return conversation_list(user, conversation_id, query)

    def on_delete_ask(conversation_id: int | None):
        with shown_to_user():
            chat.check_deletable(conversation_id)
        return gr.Row(visible=True)

    def on_delete_confirm(user_id: str, conversation_id: int | None, query: str,
                          profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            chat.delete(user, conversation_id)
        return [], None, "", conversation_list(user, None, query), gr.Row(visible=False)

    def on_delete_cancel():
        return gr.Row(visible=False)

    def on_export(user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        # The files are handed to Gradio's cache (which serves them and deletes them on its
        # schedule, TEMP_FILES_KEPT_S) here, so that the folder they were written in goes at once.
        with shown_to_user(), tempfile.TemporaryDirectory(prefix="pagedchat-export-") as folder:
            files = [exported.move_resource_to_block_cache(path) for path in chat.export(user, conversation_id, folder)]
        return gr.File(value=files, visible=True)

    def on_import(user_id: str, upload: str | None, query: str, profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        if not upload:
            raise gr.Error("Choose an exported chat (a .json file) to import.")
        with shown_to_user():
            conversation_id = chat.import_file(user, upload)
            opened = chat.open_chat(user, conversation_id)
        return (opened.messages, conversation_id, opened.preset, opened.custom, opened.title,
                opened.last_user_message, conversation_list(user, conversation_id, query))

    def on_delete_all_confirm(user_id: str, profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            deleted = chat.delete_all(user)
        gr.Info(f"Deleted {deleted} chat{'s' if deleted != 1 else ''}.")
        return [], None, "", "", conversation_list(user, None), gr.Row(visible=False)

    def on_meter(user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None):
        """The model and context line, the offers once the chat is nearly full, and the strip."""
        user = identity.resolve_user(user_id, profile)
        try:
            use, fit = chat.context(user, conversation_id)
        except ChatInputError:  # a chat deleted meanwhile: show the empty line
            conversation_id = None
            use, fit = chat.context(user, None)
        return (context_meter.meter_html(use), gr.Row(visible=use.near_limit or fit), gr.Checkbox(value=fit),
                on_memory(user_id, conversation_id, profile))

    def on_memory(user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None) -> str:
        user = identity.resolve_user(user_id, profile)
        try:
            memory, key = chat.memory(user, conversation_id)
        except ChatInputError:
            return chat_memory.strip_html(None, None)
        return chat_memory.strip_html(memory, key)

    def on_fit(user_id: str, conversation_id: int | None, on: bool, profile: gr.OAuthProfile | None = None):
        with shown_to_user():
            chat.set_fit_context(identity.resolve_user(user_id, profile), conversation_id, on)
        gr.Info("This chat now leaves out its oldest turns when the next one would not fit." if on else
                "This chat now refuses a turn that would not fit, and says so.")

    async def on_continue(user_id: str, conversation_id: int | None, temperature: float, top_p: float,
                          max_tokens: float, query: str, request: gr.Request,
                          profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        with shown_to_user():
            continuation = await asyncio.to_thread(chat.continue_with_summary, user, conversation_id,
                                                   (temperature, top_p, max_tokens), identity.origin_of(request))
            new_id = await continuation.new_chat()
            opened = await asyncio.to_thread(chat.open_chat, user, new_id)
        gr.Info("A new chat carries a summary of the old one in its system prompt (under the parameters).")
        return (opened.messages, new_id, opened.preset, opened.custom, opened.title, opened.last_user_message,
                conversation_list(user, new_id, query))

    def on_preset_change(preset: str):
        return gr.Textbox(visible=preset == presets.CUSTOM)

    # ---- layout, top to bottom --------------------------------------------------------------
    with gr.Blocks(title="PagedChat", delete_cache=(TEMP_FILES_KEPT_S, TEMP_FILES_KEPT_S)) as demo:
        browser_id = gr.BrowserState("", storage_key=BROWSER_KEY, secret=BROWSER_SECRET)
        user_id = gr.Textbox(visible=False, label="user id")
        # No precision: Gradio's rounding would turn 1.5 into 2 and fail on text; the controller
        # checks the id and says what is wrong with it.
        conversation_id = gr.Number(value=None, visible=False, label="conversation id")

        with gr.Sidebar():
            gr.Markdown("## PagedChat")
            if on_space():
                gr.LoginButton()
            new_chat = gr.Button("➕ New chat", variant="primary")
            search = gr.Textbox(placeholder="Search your chats…", show_label=False, submit_btn=True)
            conversations = gr.Radio(choices=[], label="Your chats", type="value")
            with gr.Accordion("This chat: rename, export, delete", open=False):
                title = gr.Textbox(label="Title")
                rename = gr.Button("Rename")
                delete = gr.Button("Delete chat", variant="stop")
                with gr.Row(visible=False) as confirm_row:
                    confirm_delete = gr.Button("Yes, delete it", variant="stop")
                    cancel_delete = gr.Button("Cancel")
                export = gr.Button("Export as Markdown and JSON")
                exported = gr.File(label="Exported", file_count="multiple", visible=False, interactive=False,
                                   elem_id="pc-exported")
            with gr.Accordion("All my chats", open=False):
                import_chat = gr.UploadButton("Import a chat (JSON)", file_types=[".json"], file_count="single")
                delete_all = gr.Button("Delete all my chats", variant="stop")
                with gr.Column(visible=False) as confirm_all:
                    gr.Markdown("Delete **every** chat of yours, for good?")
                    with gr.Row():
                        confirm_delete_all = gr.Button("Yes, delete all", variant="stop")
                        cancel_delete_all = gr.Button("Cancel")

        # The chat fills the window above the input (min 320 px), on a phone as on a desktop.
        chatbot = gr.Chatbot(label="Chat", height="calc(100dvh - 300px)", min_height=320, sanitize_html=True, render_markdown=True,
                             allow_tags=False, buttons=["copy"], editable="user", elem_id=page_script.CHATBOT,
                             latex_delimiters=LATEX)
        # The `‹ ›` links' target (see ui/page_script.py): hidden, but in the page.
        version = gr.Textbox(elem_id=page_script.VERSION_BOX, elem_classes=["pc-hidden"], show_label=False,
                             container=False)
        meter = gr.HTML(elem_id=page_script.METER)
        with gr.Row(visible=False) as full_row:
            fit_context = gr.Checkbox(label="When the chat is full, leave out its oldest turns", value=False)
            continue_chat = gr.Button("Continue in a new chat with a summary")
        with gr.Row():
            message = gr.Textbox(placeholder="Message PagedChat…", show_label=False, scale=8, autofocus=True)
            send = gr.Button("Send", variant="primary", scale=1, min_width=72)
            stop = gr.Button("Stop", variant="stop", scale=1, min_width=72, interactive=False,
                             elem_id=page_script.STOP_BUTTON)
        # This chat's KV blocks, refreshed while a reply streams (the timer runs only then).
        strip = gr.HTML(chat_memory.strip_html(None, None), elem_id=page_script.MEMORY)
        strip_timer = gr.Timer(STRIP_INTERVAL_S, active=False)
        with gr.Row():
            regenerate = gr.Button("🔄 Regenerate last reply")
        with gr.Accordion("Edit your last message and resend", open=False):
            edited = gr.Textbox(show_label=False, lines=3)
            resend = gr.Button("Resend edited message")
        with gr.Accordion("System prompt and parameters", open=False):
            preset = gr.Dropdown(presets.CHOICES, value=presets.DEFAULT, label="System prompt",
                                 info="Presets are shared, so their KV blocks come from the prefix cache.")
            custom = gr.Textbox(label="Custom system prompt", lines=3, visible=False)
            temperature = gr.Slider(params.TEMPERATURE.minimum, params.TEMPERATURE.maximum,
                                    value=params.TEMPERATURE.default, step=params.TEMPERATURE.step,
                                    label="Temperature")
            top_p = gr.Slider(params.TOP_P.minimum, params.TOP_P.maximum, value=params.TOP_P.default,
                              step=params.TOP_P.step, label="Top-p")
            max_tokens = gr.Slider(params.MAX_TOKENS.minimum, params.MAX_TOKENS.maximum,
                                   value=params.MAX_TOKENS.default, step=params.MAX_TOKENS.step,
                                   label="Max new tokens")

        # ---- events -------------------------------------------------------------------------
        sampling = [temperature, top_p, max_tokens]
        meter_update = dict(fn=on_meter, inputs=[user_id, conversation_id],
                            outputs=[meter, full_row, fit_context, strip], api_visibility="private")
        demo.load(on_load, [browser_id], [browser_id, user_id, conversations], api_visibility="private").then(
            **meter_update)
        after_turn = dict(fn=on_turn_end, inputs=[user_id, conversation_id, search],
                          outputs=[conversations, edited], api_visibility="private")
        # While a reply streams only Stop is enabled: each turn's trigger also disables the others
        # (unqueued, so it lands before the turn's chain can end), and the chain settles them from
        # the server's view of the chat once the turn (or Stop) has ended. The turn is the trigger's
        # own event, not chained after the disabling one: chained, Stop's `cancels` sometimes
        # missed it and the reply ran on.
        controls = [send, regenerate, resend, stop]
        settle = dict(fn=on_settle, inputs=[user_id, conversation_id], outputs=[*controls, strip_timer],
                      api_visibility="private")
        for trigger in (send.click, message.submit, regenerate.click, resend.click, chatbot.edit):
            trigger(on_turn_start, None, [*controls, strip_timer], queue=False, api_visibility="private")
        strip_timer.tick(on_memory, [user_id, conversation_id], [strip], show_progress="hidden",
                         api_visibility="private")
        # The engine batches every stream, so the queue must not serialise them.
        streaming = dict(concurrency_limit=None)
        send_inputs = [user_id, conversation_id, message, preset, custom, *sampling]
        send_outputs = [chatbot, conversation_id, message]
        sent = send.click(on_send, send_inputs, send_outputs, api_name="send", **streaming)
        submitted = message.submit(on_send, send_inputs, send_outputs, api_visibility="private", **streaming)
        regenerated = regenerate.click(on_regenerate, [user_id, conversation_id, *sampling],
                                       [chatbot, conversation_id], api_name="regenerate", **streaming)
        resent = resend.click(on_edit, [user_id, conversation_id, edited, *sampling],
                              [chatbot, conversation_id], api_name="edit_last", **streaming)
        edited_any = chatbot.edit(on_edit_message, [user_id, conversation_id, *sampling], [chatbot, conversation_id],
                                  api_visibility="private", **streaming)
        for event in (sent, submitted, regenerated, resent, edited_any):
            event.then(**after_turn).then(**settle).then(**meter_update)
        conversation_id.change(**meter_update)
        stop.click(None, None, None, cancels=[sent, submitted, regenerated, resent, edited_any]).then(
            on_stopped, [user_id, conversation_id], [chatbot], api_visibility="private").then(
            **after_turn).then(**settle).then(**meter_update)

        new_chat.click(on_new_chat, None, [chatbot, conversation_id, title, edited, conversations],
                       api_visibility="private")
        conversations.input(on_select, [user_id, conversations],
                            [chatbot, conversation_id, preset, custom, title, edited], api_name="open_chat")
        version.change(on_show_version, [user_id, conversation_id, version], [chatbot, edited],
                       api_name="show_version").then(**meter_update)
        fit_context.input(on_fit, [user_id, conversation_id, fit_context], None, api_visibility="private").then(
            **meter_update)
        continue_chat.click(on_continue, [user_id, conversation_id, *sampling, search],
                            [chatbot, conversation_id, preset, custom, title, edited, conversations],
                            api_visibility="private")
        search.submit(on_search, [user_id, search, conversation_id], [conversations], api_name="search")
        rename.click(on_rename, [user_id, conversation_id, title, search], [conversations], api_name="rename")
        delete.click(on_delete_ask, [conversation_id], [confirm_row], api_visibility="private")
        confirm_delete.click(on_delete_confirm, [user_id, conversation_id, search],
                             [chatbot, conversation_id, title, conversations, confirm_row], api_name="delete_chat")
        cancel_delete.click(on_delete_cancel, None, [confirm_row], api_visibility="private")
        export.click(on_export, [user_id, conversation_id], [exported], api_visibility="private")
        import_chat.upload(on_import, [user_id, import_chat, search],
                           [chatbot, conversation_id, preset, custom, title, edited, conversations],
                           api_visibility="private")
        delete_all.click(lambda: gr.Column(visible=True), None, [confirm_all], api_visibility="private")
        cancel_delete_all.click(lambda: gr.Column(visible=False), None, [confirm_all], api_visibility="private")
        confirm_delete_all.click(on_delete_all_confirm, [user_id],
                                 [chatbot, conversation_id, title, edited, conversations, confirm_all],
                                 api_name="delete_all_chats")
        preset.change(on_preset_change, [preset], [custom], api_visibility="private")
    return demo
