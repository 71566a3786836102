"""The chat page: conversation sidebar, chat view with streaming replies, system prompt and
sampling parameters. Handlers are named after their events; every Store call names the user.

The user id travels as a hidden input filled from the browser's storage on load (an API caller
passes it explicitly); `identity.resolve_user` checks it, or takes the Space's OAuth profile.
"""
from __future__ import annotations

import logging
import os
import threading
from contextlib import closing
from collections.abc import Callable, Iterator

import gradio as gr

from engine import EngineClient
from storage import NotFound, Store
from ui import identity, params, presets, render
from ui.stream import ReplyStream, start_reply

log = logging.getLogger(__name__)

TITLE_CHARS = 48
# A fixed key and secret keep the browser's id readable across server restarts; the id is
# the browser's own, so the encryption only guards against casual reading of localStorage.
BROWSER_KEY = "pagedchat-user"
BROWSER_SECRET = os.environ.get("PAGEDCHAT_BROWSER_SECRET", "pagedchat-browser-state")


def build_chat(client: EngineClient, store: Store) -> gr.Blocks:
    """The chat page around one engine client and one store."""

    # ---- helpers shared by the handlers -----------------------------------------------------
    def conversation_choices(user: str, query: str = "") -> list[tuple[str, int]]:
        if query.strip():
            return [(f"{c['title']} — {c['snippet']}", c["id"]) for c in store.search(user, query)]
        return [(c["title"], c["id"]) for c in store.conversations(user)]

    def conversation_list(user: str, selected: int | None, query: str = "") -> gr.Radio:
        return gr.Radio(choices=conversation_choices(user, query), value=selected)

    def stored_messages(user: str, conversation_id: int | None) -> list[dict]:
        return store.messages(user, conversation_id) if conversation_id else []

    def prompt_of(system: str, rows: list[dict]) -> list[dict]:
        head = [{"role": "system", "content": system}] if system.strip() else []
        return head + [{"role": m["role"], "content": m["content"]} for m in rows]

    # Stop cancels the streaming event; its generator then stores the partial reply on its own
    # thread. The view is redrawn from the store once that is done (see `on_stopped`).
    streams_ending: dict[int, threading.Event] = {}

    def stream_reply(reply: ReplyStream, shown: list[dict], conversation_id: int,
                     save: Callable[[str, dict], dict | None]) -> Iterator[tuple]:
        """Show the reply as it grows, then store it with its numbers. Closing this generator
        (the Stop button cancels the event) aborts the engine request and stores the partial
        reply as stopped."""
        completed = False
        ended = streams_ending[conversation_id] = threading.Event()
        try:
            for _ in reply:
                live = {"role": "assistant", "content": reply.text or "…"}
                yield shown + [render.chat_message(live)], conversation_id
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
            if completed and streams_ending.get(conversation_id) is ended:
                del streams_ending[conversation_id]
        if reply.finish_reason == "error" or (reply.finish_reason == "abort" and not reply.text):
            problem = reply.error or "the engine ended this reply early"
            if reply.text.strip():
                save(reply.text, reply.metrics())
            yield shown + [render.error_message(f"The engine could not finish this reply: {problem}. "
                                                "Try again or start a new chat.")], conversation_id
            return
        if not reply.text.strip():
            yield shown + [render.error_message("The model returned an empty reply.")], conversation_id
            return
        metrics = reply.metrics()
        if reply.finish_reason == "abort":
            metrics.update(finish_reason="abort", stopped=True)
        row = save(reply.text, metrics)
        yield shown + [render.chat_message(row)], conversation_id

    def begin_reply(system: str, rows: list[dict], sampling,
                    conversation_id: int | None) -> tuple[ReplyStream | None, list[dict]]:
        """Submit the conversation so far: (the reply, the view), or (None, the view ending in
        the refusal) when the engine will not take it."""
        shown = render.chat_messages(rows)
        try:
            return start_reply(client, prompt_of(system, rows), sampling, conversation_id), shown
        except ValueError as error:
            return None, shown + [render.error_message(refused(error))]

    def checked_params(temperature: float, top_p: float, max_tokens: float):
        try:
            return params.sampling_params(temperature, top_p, max_tokens)
        except ValueError as error:
            raise gr.Error(str(error)) from None

    def refused(error: ValueError) -> str:
        return (f"This conversation is too long for the model's memory ({error}). "
                "Start a new chat or send a shorter message.")

    # ---- handlers ---------------------------------------------------------------------------
    def on_load(stored_id: str | None, profile: gr.OAuthProfile | None = None):
        browser_id = stored_id if identity.is_anonymous_id(stored_id) else identity.new_anonymous_id()
        user = identity.resolve_user(browser_id, profile)
        return browser_id, user, conversation_list(user, None)

    def on_send(user_id: str, conversation_id: int | None, message: str, preset: str, custom: str,
                temperature: float, top_p: float, max_tokens: float,
                profile: gr.OAuthProfile | None = None) -> Iterator[tuple]:
        user = identity.resolve_user(user_id, profile)
        text = (message or "").strip()
        if not text:
            raise gr.Error("Type a message first.")
        sampling = checked_params(temperature, top_p, max_tokens)
        system = presets.system_prompt(preset, custom)
        reply, shown = begin_reply(system, stored_messages(user, conversation_id) + [{"role": "user", "content": text}],
                                   sampling, conversation_id)
        if reply is None:
            yield shown, conversation_id, message
            return
        if conversation_id is None:
            conversation_id = store.create_conversation(user, title=text[:TITLE_CHARS], system_prompt=system)["id"]
        elif store.conversation(user, conversation_id)["system_prompt"] != system:
            store.set_system_prompt(user, conversation_id, system)
        store.add_message(user, conversation_id, "user", text)
        yield shown, conversation_id, ""

        def save(content: str, metrics: dict) -> dict:
            return store.add_message(user, conversation_id, "assistant", content, **metrics)

        # closing() so that Stop, which closes this generator, also closes the inner one now.
        with closing(stream_reply(reply, shown, conversation_id, save)) as views:
            for view, cid in views:
                yield view, cid, ""

    def on_regenerate(user_id: str, conversation_id: int | None, temperature: float, top_p: float,
                      max_tokens: float, profile: gr.OAuthProfile | None = None) -> Iterator[tuple]:
        user = identity.resolve_user(user_id, profile)
        rows = stored_messages(user, conversation_id)
        if not rows:
            raise gr.Error("Nothing to regenerate yet.")
        replacing = rows[-1]["role"] == "assistant"
        rows = rows[:-1] if replacing else rows
        sampling = checked_params(temperature, top_p, max_tokens)
        reply, shown = begin_reply(store.conversation(user, conversation_id)["system_prompt"], rows, sampling,
                                   conversation_id)
        if reply is None:
            yield shown, conversation_id
            return

        def save(content: str, metrics: dict) -> dict:
            if replacing:
                return store.replace_last_assistant(user, conversation_id, content, **metrics)
            return store.add_message(user, conversation_id, "assistant", content, **metrics)

        yield from stream_reply(reply, shown, conversation_id, save)

    def on_edit(user_id: str, conversation_id: int | None, edited: str, temperature: float, top_p: float,
                max_tokens: float, profile: gr.OAuthProfile | None = None) -> Iterator[tuple]:
        user = identity.resolve_user(user_id, profile)
        text = (edited or "").strip()
        rows = stored_messages(user, conversation_id)
        last_user = max((i for i, m in enumerate(rows) if m["role"] == "user"), default=None)
        if not text or last_user is None:
            raise gr.Error("There is no sent message to edit, or the edit is empty.")
        sampling = checked_params(temperature, top_p, max_tokens)
        rows = rows[:last_user] + [{"role": "user", "content": text}]
        reply, shown = begin_reply(store.conversation(user, conversation_id)["system_prompt"], rows, sampling,
                                   conversation_id)
        if reply is None:
            yield shown, conversation_id
            return
        store.edit_last_user_message(user, conversation_id, text)
        yield shown, conversation_id

        def save(content: str, metrics: dict) -> dict:
            return store.add_message(user, conversation_id, "assistant", content, **metrics)

        yield from stream_reply(reply, shown, conversation_id, save)

    def on_turn_end(user_id: str, conversation_id: int | None, query: str,
                    profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        rows = stored_messages(user, conversation_id)
        last_user = next((m["content"] for m in reversed(rows) if m["role"] == "user"), "")
        return conversation_list(user, conversation_id, query), last_user

    def on_stopped(user_id: str, conversation_id: int | None, profile: gr.OAuthProfile | None = None):
        """After Stop: wait (briefly) for the cancelled stream to store what was shown, then
        redraw the chat from the store, so the reply carries its "stopped" mark."""
        user = identity.resolve_user(user_id, profile)
        ending = streams_ending.get(conversation_id) if conversation_id is not None else None
        if ending is not None:
            ending.wait(timeout=5.0)
        return render.chat_messages(stored_messages(user, conversation_id))

    def on_new_chat():
        return [], None, "", "", gr.Radio(value=None)

    def on_select(user_id: str, selected: int | None, profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        if selected is None:
            return [], None, gr.Dropdown(), gr.Textbox(), "", ""
        try:
            conversation = store.conversation(user, selected)
        except NotFound:
            raise gr.Error("That conversation no longer exists.") from None
        rows = store.messages(user, selected)
        preset, custom = presets.preset_for(conversation["system_prompt"])
        last_user = next((m["content"] for m in reversed(rows) if m["role"] == "user"), "")
        return render.chat_messages(rows), selected, preset, custom, conversation["title"], last_user

    def on_search(user_id: str, query: str, conversation_id: int | None,
                  profile: gr.OAuthProfile | None = None):
        return conversation_list(identity.resolve_user(user_id, profile), conversation_id, query)

    def on_rename(user_id: str, conversation_id: int | None, title: str, query: str,
                  profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        if conversation_id is None or not (title or "").strip():
            raise gr.Error("Open a chat and type its new title first.")
        store.rename(user, conversation_id, title)
        return conversation_list(user, conversation_id, query)

    def on_delete_ask(conversation_id: int | None):
        if conversation_id is None:
            raise gr.Error("Open a chat to delete it.")
        return gr.Row(visible=True)

    def on_delete_confirm(user_id: str, conversation_id: int | None, query: str,
                          profile: gr.OAuthProfile | None = None):
        user = identity.resolve_user(user_id, profile)
        if conversation_id is not None:
            store.delete_conversation(user, conversation_id)
        return [], None, "", conversation_list(user, None, query), gr.Row(visible=False)

    def on_delete_cancel():
        return gr.Row(visible=False)

    def on_preset_change(preset: str):
        return gr.Textbox(visible=preset == presets.CUSTOM)

    # ---- layout, top to bottom --------------------------------------------------------------
    with gr.Blocks(title="PagedChat") as demo:
        browser_id = gr.BrowserState("", storage_key=BROWSER_KEY, secret=BROWSER_SECRET)
        user_id = gr.Textbox(visible=False, label="user id")
        conversation_id = gr.Number(value=None, precision=0, visible=False, label="conversation id")

        with gr.Sidebar():
            gr.Markdown("## PagedChat")
            if identity.on_space():
                gr.LoginButton()
            new_chat = gr.Button("➕ New chat", variant="primary")
            search = gr.Textbox(placeholder="Search your chats…", show_label=False, submit_btn=True)
            conversations = gr.Radio(choices=[], label="Your chats", type="value")
            with gr.Accordion("Rename or delete this chat", open=False):
                title = gr.Textbox(label="Title")
                rename = gr.Button("Rename")
                delete = gr.Button("Delete chat", variant="stop")
                with gr.Row(visible=False) as confirm_row:
                    confirm_delete = gr.Button("Yes, delete it", variant="stop")
                    cancel_delete = gr.Button("Cancel")

        chatbot = gr.Chatbot(label="Chat", height=560, sanitize_html=True, render_markdown=True,
                             allow_tags=False, buttons=["copy"])
        with gr.Row():
            message = gr.Textbox(placeholder="Message PagedChat…", show_label=False, scale=8, autofocus=True)
            send = gr.Button("Send", variant="primary", scale=1)
            stop = gr.Button("Stop", variant="stop", scale=1)
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
        demo.load(on_load, [browser_id], [browser_id, user_id, conversations], api_visibility="private")

        sampling = [temperature, top_p, max_tokens]
        after_turn = dict(fn=on_turn_end, inputs=[user_id, conversation_id, search],
                          outputs=[conversations, edited], api_visibility="private")
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
        for event in (sent, submitted, regenerated, resent):
            event.then(**after_turn)
        stop.click(None, None, None, cancels=[sent, submitted, regenerated, resent]).then(
            on_stopped, [user_id, conversation_id], [chatbot], api_visibility="private").then(**after_turn)

        new_chat.click(on_new_chat, None, [chatbot, conversation_id, title, edited, conversations],
                       api_visibility="private")
        conversations.input(on_select, [user_id, conversations],
                            [chatbot, conversation_id, preset, custom, title, edited], api_name="open_chat")
        search.submit(on_search, [user_id, search, conversation_id], [conversations], api_name="search")
        rename.click(on_rename, [user_id, conversation_id, title, search], [conversations], api_name="rename")
        delete.click(on_delete_ask, [conversation_id], [confirm_row], api_visibility="private")
        confirm_delete.click(on_delete_confirm, [user_id, conversation_id, search],
                             [chatbot, conversation_id, title, conversations, confirm_row], api_name="delete_chat")
        cancel_delete.click(on_delete_cancel, None, [confirm_row], api_visibility="private")
        preset.change(on_preset_change, [preset], [custom], api_visibility="private")
    return demo
