"""What the browser tests share: Debian's chromium driven by Playwright (headless), the app
served on a free port, and a browser profile that fails the test on any page error.

`make browser` installs chromium (never `playwright install`); without it every browser test
module is skipped with the reason."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from served_app import free_port, serve  # noqa: F401  (the browser tests' server)
from waiting import DEADLINE_S, poll

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1280, "height": 800}
USER_KEY = "pagedchat-user"  # ui.chat.BROWSER_KEY: where the browser keeps its anonymous id
TIMEOUT_MS = int(DEADLINE_S * 1000)  # a bound on a hang, for page actions and `expect` alike
# Playwright's `expect` waits 5 s unless told: a sidebar that updated in 6 s on a busy machine
# (three pytest workers on two cores) failed a test.
sync_api.expect.set_options(timeout=TIMEOUT_MS)

if not os.path.exists(CHROMIUM):
    pytest.skip(f"no {CHROMIUM}: run `make browser` (as root) to install Debian's chromium",
                allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Browser:
    """One browser profile (its own local storage, so its own anonymous user). Every page error
    and console error fails the test, except the console errors Gradio's client logs when a
    reload cuts its open event stream ("Connection errored out")."""

    def __init__(self, browser, url: str):
        self.context = browser.new_context(viewport=VIEWPORT)
        self.url = url
        self.errors: list[str] = []
        self.reloading = False

    def open(self, path: str = "", viewport: dict | None = None):
        """A new page at the app's `path`: "" is the chat (ready once it has its user id)."""
        page = self.context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        if viewport:
            page.set_viewport_size(viewport)
        page.on("pageerror", lambda error: self.on_page_error(page, error))
        page.on("console", self.on_console)
        page.goto(self.url + path)
        if not path:
            page.wait_for_function(f"() => !!localStorage.getItem('{USER_KEY}')")  # on_load has run
        return page

    def on_page_error(self, page, error) -> None:
        # Where it came from, for a failure seen once: the page, whether a reload was cutting its
        # streams, and the script's innermost frames.
        where = " while reloading" if self.reloading else ""
        stack = " | ".join((getattr(error, "stack", "") or "").splitlines()[1:4])
        self.errors.append(f"page error at {page.url}{where}: {error} [{stack.strip()}]")

    def on_console(self, message) -> None:
        if message.type == "error" and not self.reloading:
            self.errors.append(f"console: {message.text}")

    def reload(self, page) -> None:
        self.reloading = True
        try:
            page.reload()
        finally:
            self.reloading = False


def screenshot_target(default_name: str, tmp_path: Path) -> Path:
    """Where a README screenshot goes: a temporary file, or docs/<default_name> when
    PAGEDCHAT_SCREENSHOT=1 (another value is taken as the path)."""
    target = os.environ.get("PAGEDCHAT_SCREENSHOT") or str(tmp_path / default_name)
    return Path(__file__).parent.parent / "docs" / default_name if target == "1" else Path(target)


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def set_slider(page, label: str, value: float) -> None:
    """Type `value` into a Gradio slider's number box and wait until the slider holds it (a
    slider that has just mounted may still take its initial value)."""
    box = page.get_by_role("spinbutton", name=f"number input for {label}")
    slider = page.get_by_role("slider", name=f"range slider for {label}")
    for _ in range(20):
        box.fill(str(value))
        box.press("Tab")
        if float(slider.input_value()) == value:
            return
        time.sleep(0.1)
    raise AssertionError(f"{label} stayed at {slider.input_value()}")


def set_params(page, max_tokens: int, temperature: float = 0.0) -> None:
    """Type the values into the chat page's sliders' number boxes (in the parameters accordion)."""
    max_box = page.get_by_role("spinbutton", name="number input for Max new tokens")
    # The header toggles the accordion. A click could be lost while the page was still settling
    # (once in a loaded suite run, on the phone-sized page): clicked again until the box shows.
    deadline = time.monotonic() + DEADLINE_S
    while not max_box.is_visible():
        assert time.monotonic() < deadline, f"the parameters accordion did not open in {DEADLINE_S} s"
        page.get_by_text("System prompt and parameters").click()
        try:
            max_box.wait_for(state="visible", timeout=15_000)
        except sync_api.TimeoutError:
            pass
    set_slider(page, "Max new tokens", max_tokens)
    set_slider(page, "Temperature", temperature)


def send(page, text: str) -> None:
    """Type `text` into the message box and send it, clicking Send again only if the page did
    not take the click: a click could be lost while the page was still settling (once in a loaded
    suite run, right after signing in: the box kept the text, Send stayed enabled, no turn began).
    A click the page takes disables Send at once (or, done already, empties the box): never sent twice."""
    box = page.get_by_placeholder("Message PagedChat…")
    button = page.get_by_role("button", name="Send", exact=True)
    box.fill(text)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        button.click()
        if poll(lambda: not button.is_enabled() or box.input_value() == "", timeout=15):
            return
        assert time.monotonic() < deadline, f"Send did not take the message in {DEADLINE_S} s"
