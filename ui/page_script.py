"""The chat page's script and style: what Gradio's components cannot do on their own.

- Copy: the chatbot holds a message as escaped text plus a footer (ui/render.py); its Copy
  button writes that string. For that button only (a click in a message's row of buttons arms
  the clipboard for the one write it makes) the script hands the clipboard the message's source
  instead: a reply's base64 `data-source` from the footer the app appended last (a reply's own
  text may contain `data-source="…"` too, so only the one at the very end counts), or a user
  message's text with the footer dropped and the escaping undone (outside code, as
  `render.source_of` does). Every other write (a code block's copy button) is left as it is.
- Versions: a click on a `‹`/`›` link puts "<message id>:<time>" into the hidden `#pc-version`
  box, whose change event asks the server to show that version.
- Esc presses Stop while a reply streams (Enter and Shift+Enter are the message box's own).
- Layout: on a narrow screen (a phone) the sidebar starts folded; the chatbot's own height
  (ui/chat.py) fills the window.
"""
from __future__ import annotations

VERSION_BOX = "pc-version"
STOP_BUTTON = "pc-stop"
CHATBOT = "pc-chat"
METER = "pc-meter"
MEMORY = "pc-memory"
NARROW_PX = 768  # below this width (a phone), the sidebar starts folded

HEAD = """
<script>
(() => {
  if (window.pagedchatScript) return;
  window.pagedchatScript = true;
  const CODE = /(```[\\s\\S]*?(?:```|$)|`[^`\\n]+`)/;
  // The app's footer is one line, always last; a reply's source is the footer's last element.
  const FOOTER = /\\n\\n<div class="pc-meta">[^\\n]*<\\/div>$/;
  const SOURCE = /<span class="pc-source" data-source="([A-Za-z0-9+\\/=]*)"><\\/span><\\/div>$/;
  const unescape = (text) => text.replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&amp;/g, "&");
  const source = (shown, role) => {
    const encoded = role === "bot" && SOURCE.exec(shown);
    if (encoded) return new TextDecoder().decode(Uint8Array.from(atob(encoded[1]), (c) => c.charCodeAt(0)));
    return shown.replace(FOOTER, "").split(CODE).map((part, i) => (i % 2 ? part : unescape(part))).join("");
  };
  // Whose message the chatbot's Copy button is copying ("bot" or "user"), for the one clipboard
  // write its click makes (synchronously, within the click's dispatch); null for any other write.
  let copying = null;
  const roleOf = (buttons) => {
    let row = buttons.previousElementSibling;
    while (row && !row.classList.contains("message-row")) row = row.previousElementSibling;
    const bubble = row && row.querySelector('[data-testid="bot"], [data-testid="user"]');
    return bubble ? bubble.getAttribute("data-testid") : null;
  };
  document.addEventListener("click", (event) => {
    const button = event.target.closest && event.target.closest("#CHATBOT .message-buttons button");
    if (!button) return;
    copying = roleOf(button.closest(".message-buttons"));
    setTimeout(() => { copying = null; });  // after the click's handlers: an unused arming expires
  }, true);
  if (navigator.clipboard) {
    const write = navigator.clipboard.writeText.bind(navigator.clipboard);
    navigator.clipboard.writeText = (text) => {
      const role = copying;
      copying = null;
      return write(role ? source(String(text), role) : text);
    };
  }
  document.addEventListener("click", (event) => {
    const link = event.target.closest && event.target.closest('a[href^="#pc-version-"]');
    if (!link) return;
    event.preventDefault();
    event.stopPropagation();
    const box = document.querySelector("#VERSION_BOX textarea, #VERSION_BOX input");
    if (!box) return;
    const setter = Object.getOwnPropertyDescriptor(Object.getPrototypeOf(box), "value").set;
    // A changing value, so that the same version asked for twice is still a change.
    setter.call(box, link.getAttribute("href").slice("#pc-version-".length) + ":" + Date.now());
    box.dispatchEvent(new Event("input", { bubbles: true }));
  }, true);
  // On a narrow screen the sidebar would cover the chat: it starts folded (its toggle opens it).
  if (window.innerWidth < NARROW_PX) {
    const started = Date.now();
    const fold = setInterval(() => {
      const sidebar = document.querySelector(".sidebar");
      if (sidebar || Date.now() - started > 20000) clearInterval(fold);
      if (sidebar && sidebar.classList.contains("open")) sidebar.querySelector(".toggle-button").click();
    }, 50);
  }
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Escape") return;
    const stop = document.getElementById("STOP_BUTTON");
    if (stop && !stop.disabled) stop.click();
  });
})();
</script>
""".replace("VERSION_BOX", VERSION_BOX).replace("STOP_BUTTON", STOP_BUTTON).replace("NARROW_PX", str(NARROW_PX)).replace(
    "CHATBOT", CHATBOT)

CSS = """
.pc-hidden { display: none !important; }
.pc-meta { font-size: 0.85em; opacity: 0.8; margin-top: 0.4em; }
.pc-meta a { text-decoration: none; padding: 0 0.3em; font-weight: bold; }
.pc-meta .pc-off { opacity: 0.35; padding: 0 0.3em; }
.pc-meter { font-size: 0.85em; opacity: 0.85; display: flex; flex-wrap: wrap; gap: 0.4em; align-items: center; }
.pc-meter-bar { display: inline-block; width: 8em; height: 0.5em; border-radius: 0.25em;
                background: var(--border-color-primary); overflow: hidden; vertical-align: middle; }
.pc-meter-bar span { display: block; height: 100%; background: var(--color-accent); }
.pc-near .pc-meter-bar span { background: #d97706; }
.pc-meter-warn { color: #b45309; }
.pc-memory { font-size: 0.8em; opacity: 0.85; }
.pc-kv-squares { display: inline-flex; flex-wrap: wrap; gap: 1px; vertical-align: middle; max-width: 100%; }
.pc-kv { display: inline-block; width: 7px; height: 7px; border-radius: 1px; }
.pc-kv-shared { background: #f97316; }
.pc-kv-own { background: var(--color-accent); }
.pc-kv-host { background: #94a3b8; }
"""
