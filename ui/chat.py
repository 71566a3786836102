"""The chat page (Gradio), declared top to bottom: the sidebar, the chat and its input, the
parameters; then the events, each wired to a handler of ui/chat_events.py named after it
(`send.click` → `on_send`). The handlers ask the `ChatController` (ui/conversation.py), the
page's logic without Gradio.

The user id travels as a hidden input filled from the browser's storage on load (an API caller
passes it explicitly); `identity.resolve_user` checks it, or takes the Space's OAuth profile.
"""
from __future__ import annotations

import os

import gradio as gr

from storage import Store
from ui import chat_memory, page_script, params, presets
from ui.backends.backend import ChatBackend
from ui.chat_events import ChatEvents
from ui.conversation import ChatController
from ui.sessions import Sessions
from ui.space import on_space

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


def build_chat(backend: ChatBackend, store: Store, sessions: Sessions | None = None) -> gr.Blocks:
    """The chat page around one backend (whatever writes the replies) and one store. With
    `sessions` (watched by the server's middleware), a reply whose browser disconnects is
    cancelled at once."""
    chat = ChatController(backend, store)

    # ---- layout, top to bottom ------------------------------------------------------------------
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

        # ---- events, each to its handler in ui/chat_events.py -----------------------------------
        events = ChatEvents(chat, sessions, exported)
        sampling = [temperature, top_p, max_tokens]
        meter_update = dict(fn=events.on_meter, inputs=[user_id, conversation_id],
                            outputs=[meter, full_row, fit_context, strip], api_visibility="private")
        demo.load(events.on_load, [browser_id], [browser_id, user_id, conversations], api_visibility="private").then(
            **meter_update)
        after_turn = dict(fn=events.on_turn_end, inputs=[user_id, conversation_id, search],
                          outputs=[conversations, edited], api_visibility="private")
        # While a reply streams only Stop is enabled: each turn's trigger also disables the others
        # (unqueued, so it lands before the turn's chain can end), and the chain settles them from
        # the server's view of the chat once the turn (or Stop) has ended. The turn is the trigger's
        # own event, not chained after the disabling one: chained, Stop's `cancels` sometimes
        # missed it and the reply ran on.
        controls = [send, regenerate, resend, stop]
        settle = dict(fn=events.on_settle, inputs=[user_id, conversation_id], outputs=[*controls, strip_timer],
                      api_visibility="private")
        for trigger in (send.click, message.submit, regenerate.click, resend.click, chatbot.edit):
            trigger(events.on_turn_start, None, [*controls, strip_timer], queue=False, api_visibility="private")
        strip_timer.tick(events.on_memory, [user_id, conversation_id], [strip], show_progress="hidden",
                         api_visibility="private")
        # The engine batches every stream, so the queue must not serialise them.
        streaming = dict(concurrency_limit=None)
        send_inputs = [user_id, conversation_id, message, preset, custom, *sampling]
        send_outputs = [chatbot, conversation_id, message]
        sent = send.click(events.on_send, send_inputs, send_outputs, api_name="send", **streaming)
        submitted = message.submit(events.on_send, send_inputs, send_outputs, api_visibility="private", **streaming)
        regenerated = regenerate.click(events.on_regenerate, [user_id, conversation_id, *sampling],
                                       [chatbot, conversation_id], api_name="regenerate", **streaming)
        resent = resend.click(events.on_edit, [user_id, conversation_id, edited, *sampling],
                              [chatbot, conversation_id], api_name="edit_last", **streaming)
        edited_any = chatbot.edit(events.on_edit_message, [user_id, conversation_id, *sampling],
                                  [chatbot, conversation_id], api_visibility="private", **streaming)
        for event in (sent, submitted, regenerated, resent, edited_any):
            event.then(**after_turn).then(**settle).then(**meter_update)
        conversation_id.change(**meter_update)
        stop.click(None, None, None, cancels=[sent, submitted, regenerated, resent, edited_any]).then(
            events.on_stopped, [user_id, conversation_id], [chatbot], api_visibility="private").then(
            **after_turn).then(**settle).then(**meter_update)

        # The sidebar, the full-chat offers and the parameters.
        new_chat.click(events.on_new_chat, None, [chatbot, conversation_id, title, edited, conversations],
                       api_visibility="private")
        conversations.input(events.on_select, [user_id, conversations],
                            [chatbot, conversation_id, preset, custom, title, edited], api_name="open_chat")
        version.change(events.on_show_version, [user_id, conversation_id, version], [chatbot, edited],
                       api_name="show_version").then(**meter_update)
        fit_context.input(events.on_fit, [user_id, conversation_id, fit_context], None, api_visibility="private").then(
            **meter_update)
        continue_chat.click(events.on_continue, [user_id, conversation_id, *sampling, search],
                            [chatbot, conversation_id, preset, custom, title, edited, conversations],
                            api_visibility="private")
        search.submit(events.on_search, [user_id, search, conversation_id], [conversations], api_name="search")
        rename.click(events.on_rename, [user_id, conversation_id, title, search], [conversations], api_name="rename")
        delete.click(events.on_delete_ask, [conversation_id], [confirm_row], api_visibility="private")
        confirm_delete.click(events.on_delete_confirm, [user_id, conversation_id, search],
                             [chatbot, conversation_id, title, conversations, confirm_row], api_name="delete_chat")
        cancel_delete.click(events.on_delete_cancel, None, [confirm_row], api_visibility="private")
        export.click(events.on_export, [user_id, conversation_id], [exported], api_visibility="private")
        import_chat.upload(events.on_import, [user_id, import_chat, search],
                           [chatbot, conversation_id, preset, custom, title, edited, conversations],
                           api_visibility="private")
        delete_all.click(events.on_delete_all_ask, None, [confirm_all], api_visibility="private")
        cancel_delete_all.click(events.on_delete_all_cancel, None, [confirm_all], api_visibility="private")
        confirm_delete_all.click(events.on_delete_all_confirm, [user_id],
                                 [chatbot, conversation_id, title, edited, conversations, confirm_all],
                                 api_name="delete_all_chats")
        preset.change(events.on_preset_change, [preset], [custom], api_visibility="private")
    return demo
