"""The live engine panel page, refreshed about once a second: a row per backend (the cluster
view, from what each backend's metrics offer) with its block map where it shows one; and, for an
in-process engine, its figures, plots, block map and the load generator's controls (from the
shared PanelFeed). ui/panel/view.py and ui/panel/cluster_view.py turn them into what is drawn.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from urllib.parse import parse_qs, urlsplit

import gradio as gr

from ui import presets
from ui.backends.backend import ChatBackend
from ui import chat_memory
from ui.chat_memory import conversation_key
from ui.panel import operator
from ui.panel import view as panel_view
from ui.panel.cluster_view import CLUSTER_CSS, cluster_html
from ui.panel.load_generator import LOAD_SYSTEM_PROMPT, MAX_USERS, LoadGenerator
from ui.panel.feed import PanelFeed
from ui.space import on_space

LOAD_PROMPTS = {"Long shared prompt (~300 tokens)": LOAD_SYSTEM_PROMPT,
                **{name: text for name, text in presets.PRESETS.items() if text}}
DEFAULT_USERS = 16
DEFAULT_LOAD_TOKENS = 48
# One colour per series across redraws, so a line never changes colour when another appears.
COLORS = {"device used": "#2563eb", "device cached": "#7dd3fc", "host used": "#f97316",
          "running": "#16a34a", "waiting": "#eab308", "swapped": "#dc2626",
          "generation": "#2563eb", "computed": "#9333ea", "from cache": "#0ea5e9",
          "hit rate": "#0d9488", "swap": "#f97316", "recompute": "#dc2626",
          "out to host": "#f97316", "in from host": "#16a34a", "first token": "#64748b"}


CLUSTER_INTERVAL_S = 1.0


def marked_chat(request: gr.Request | None) -> str | None:
    """The conversation to mark in the block maps: the page's `?chat=<id>` (a chat's memory strip
    links here so), read from the event's own query or the page address it was sent from."""
    if request is None:
        return None
    value = request.query_params.get("chat")
    if value is None:
        referer = request.headers.get("referer", "")
        value = parse_qs(urlsplit(referer).query).get("chat", [None])[0]
    if value and value.isdigit():
        return conversation_key(int(value))
    return value if value and chat_memory.KEY.fullmatch(value) else None


def build_panel(backend: ChatBackend, feed: PanelFeed | None = None, load: LoadGenerator | None = None,
                host: str = "127.0.0.1", env: Mapping[str, str] = os.environ) -> None:
    """Declare the panel in the current Blocks (or page) context: the backends' rows, then the
    in-process engine's detail when `feed` and `load` watch one. `host`: the address the app is
    bound to; with `env` (read at each call) and each event's request, it decides who sees owners
    and hashes and who may run the load generator (ui/panel/operator.py)."""
    def operating(token: str | None, profile: gr.OAuthProfile | None, request: gr.Request | None) -> bool:
        peer = request.client.host if request is not None and request.client is not None else None
        return operator.may_operate(host, peer, request.headers if request is not None else {},
                                    profile.username if profile is not None else None, token, env)

    gr.HTML(f"<style>{panel_view.PANEL_CSS}{CLUSTER_CSS}</style>", padding=False)  # the styles of the HTML below
    intro = ("The KV cache as the scheduler moves it, refreshed every second. The operator's load generator "
             "shows batching, prefix hits, preemption and swapping." if feed is not None else
             "The serving engines this app chats through, refreshed every second: each one's figures from its "
             "own metrics, and its KV blocks where it publishes them.")
    gr.Markdown(f"## Engine panel\n{intro}")
    if on_space(env):
        gr.LoginButton()  # the Space's owner signs in here to run the load generator
    gr.Markdown("### Backends\nOne row per engine writing this app's replies, from what its metrics offer.")
    cluster = gr.HTML(cluster_html(backend.statuses(), time.time()), elem_id="cluster")
    names = [status.name for status in backend.statuses()]
    remote_maps = []
    if feed is None:  # the engines are elsewhere: each one's map, where it publishes one
        for i, name in enumerate(names):
            gr.Markdown(f"### Block map: {name}")
            remote_maps.append(gr.HTML(elem_id=f"block-map-{i}", elem_classes=["remote-block-map"]))

    def on_cluster_tick(token: str | None = None, profile: gr.OAuthProfile | None = None,
                        request: gr.Request | None = None):
        statuses = backend.statuses()
        maps = []
        for status in statuses[:len(remote_maps)]:
            found = backend.block_map(status.name) if status.up else None
            maps.append(panel_view.block_map_html(*found, show_private=operating(token, profile, request),
                                                  marked=marked_chat(request)) if found
                        else panel_view.no_block_map_html(status.name, None if status.up else status.problem))
        return cluster_html(statuses, time.time()), *maps

    def on_open(profile: gr.OAuthProfile | None = None, request: gr.Request | None = None):
        """The token box for whoever is not the operator yet, if a token is set."""
        return gr.Textbox(visible=not operating(None, profile, request) and bool(env.get(operator.TOKEN_ENV)))

    token = gr.Textbox(label="Admin token (to see owners and run the load generator)", type="password",
                       visible=False, elem_id="admin-token")
    gr.on(None, on_open, None, [token], api_visibility="private")  # on page load
    gr.Timer(CLUSTER_INTERVAL_S).tick(on_cluster_tick, [token], [cluster, *remote_maps], show_progress="hidden",
                                      api_visibility="private")
    if feed is not None and load is not None:
        _engine_detail(feed, load, token, operating, env)


def _engine_detail(feed: PanelFeed, load: LoadGenerator, token: gr.Textbox, operating, env: Mapping[str, str]) -> None:
    """The in-process engine's figures, plots, block map and load generator."""
    client = feed.client
    info = client.info()

    def checked_operator(token: str | None, profile: gr.OAuthProfile | None, request: gr.Request | None) -> None:
        if not operating(token, profile, request):
            raise gr.Error(operator.REFUSAL)

    def on_open(profile: gr.OAuthProfile | None = None, request: gr.Request | None = None):
        """The load generator's controls, for the operator only."""
        return gr.Row(visible=operating(None, profile, request))

    def on_token(token: str, profile: gr.OAuthProfile | None = None, request: gr.Request | None = None):
        allowed = operating(token, profile, request)
        if token and not allowed:
            gr.Warning("That is not the admin token.")
        return gr.Row(visible=allowed)

    def on_tick(freeze: bool, shown: int | None, token: str | None = None, profile: gr.OAuthProfile | None = None,
                request: gr.Request | None = None):
        history = feed.history()
        first_tokens = client.recent_first_tokens()
        frames = panel_view.plot_frames(history, first_tokens)
        grid = gr.skip()
        if not freeze:
            # The map is the page's largest update (~0.5 MB at 4k blocks): resend it only when it
            # changed, which also keeps a hovered cell's tooltip up while the engine is idle. The
            # operator's map differs from a visitor's, so giving the token resends it.
            html = panel_view.block_map_html(feed.block_map(), info,
                                             show_private=operating(token, profile, request),
                                             marked=marked_chat(request))
            if hash(html) != shown:
                grid, shown = html, hash(html)
        return (panel_view.header_html(history, info, first_tokens), *frames.values(), grid,
                panel_view.load_status_html(load.status()), shown)

    def on_start(users: float, prompt: str, max_tokens: float, token: str | None = None,
                 profile: gr.OAuthProfile | None = None, request: gr.Request | None = None):
        checked_operator(token, profile, request)
        try:
            load.start(int(users), LOAD_PROMPTS.get(prompt, LOAD_SYSTEM_PROMPT), int(max_tokens))
        except ValueError as error:
            raise gr.Error(str(error)) from None
        return panel_view.load_status_html(load.status())

    def on_stop(token: str | None = None, profile: gr.OAuthProfile | None = None,
                request: gr.Request | None = None):
        checked_operator(token, profile, request)
        load.stop()
        return panel_view.load_status_html(load.status())

    gr.Markdown("### The in-process engine")
    header = gr.HTML(panel_view.header_html(feed.history(), info, client.recent_first_tokens()),
                     elem_id="panel-header")
    with gr.Row(visible=False) as controls:  # shown to the operator only (on_open)
        users = gr.Slider(1, MAX_USERS, value=DEFAULT_USERS, step=1, label="Synthetic users", scale=2)
        prompt = gr.Dropdown(list(LOAD_PROMPTS), value=next(iter(LOAD_PROMPTS)), label="Their shared system prompt",
                             scale=2)
        max_tokens = gr.Slider(8, 256, value=DEFAULT_LOAD_TOKENS, step=8, label="Tokens per reply", scale=2)
        start = gr.Button("Start load", variant="primary", scale=1, elem_id="load-start")
        stop = gr.Button("Stop load", variant="stop", scale=1, elem_id="load-stop")
    load_status = gr.HTML(panel_view.load_status_html(load.status()), elem_id="load-status")

    plots = []
    for row in panel_view.PLOT_ROWS:
        with gr.Row():
            for name in row:
                spec = panel_view.PLOTS[name]
                plots.append(gr.LinePlot(
                    panel_view.plot_frames(feed.history(), ())[name], x="t", y=spec.y, color="series",
                    title=spec.title, x_title="seconds before now", y_title=spec.y_title, color_map=COLORS,
                    x_lim=[-panel_view.PLOT_SPAN_S, 0], y_lim=[0, 100] if spec.percent else None,
                    height=220, elem_id=f"plot-{name.replace('_', '-')}"))

    gr.Markdown("### Block map\nEvery KV block, one cell each. Hover a cell for its id, state and references "
                "(and, for the operator, its owners and hash).")
    freeze = gr.Checkbox(False, label="Freeze the block map (to hover over it while the engine runs)")
    block_map = gr.HTML(elem_id="block-map")

    shown_map = gr.State(None)  # hash of the block map this page shows
    timer = gr.Timer(feed.interval_s)
    timer.tick(on_tick, [freeze, shown_map, token], [header, *plots, block_map, load_status, shown_map],
               show_progress="hidden", api_visibility="private")
    gr.on(None, on_open, None, [controls], api_visibility="private")  # on page load
    token.submit(on_token, [token], [controls], api_visibility="private")
    start.click(on_start, [users, prompt, max_tokens, token], [load_status], api_name="start_load")
    stop.click(on_stop, [token], [load_status], api_name="stop_load")
