"""A headless Chromium for tests/test_docs_site.py's check that the site reads at 1280 px: the pages' checks
(:data:`TOO_WIDE`, :data:`BROKEN_WORDS`) and the browser that runs them.

Chromium is Debian's ``chromium`` (scripts/install.sh apt-installs it as root), driven over the DevTools protocol on
a pipe (``--remote-debugging-pipe``: JSON messages, each ended by a NUL byte, on the browser's fds 3 and 4): no port,
no websocket, no Python package, and no network (the pages render as offline, with the fallback fonts). Without
chromium the test skips, saying so, but fails under CI (``CI`` set), which installs it."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("index.html", "hpc.html", "privacy.html")
WIDTH, HEIGHT = 1280, 800
ANSWER_SECONDS = 60.0  # the longest wait for any one answer of the browser

# Each code block or table of the article wider than its box, as "kind, widths: its first 60 characters": its
# content wider than the box (scrollWidth > clientWidth: cut, or scrolled sideways), or the box past its container
# (a table past its `.md-typeset__scrollwrap`; anything else past the main column `.md-content`, whose margin a
# table's scrollwrap spans by design). Material scrolls a block's `pre > code` and a table's scrollwrap.
TOO_WIDE = r"""(() => {
  const found = [];
  for (const kind of ["pre", "pre > code", ".md-typeset__scrollwrap", ".md-typeset__table", "table"]) {
    for (const el of document.querySelectorAll(`article ${kind}`)) {
      const box = el.getBoundingClientRect();
      if (box.width === 0) continue;  // not shown (a closed block)
      const wrap = el.parentElement.closest(".md-typeset__scrollwrap");
      const container = wrap && !el.matches(".md-typeset__scrollwrap") ? wrap : el.closest(".md-content");
      const right = container.getBoundingClientRect().left + container.clientLeft + container.clientWidth;
      const width = Math.max(el.scrollWidth, Math.round(el.clientWidth + box.right - right));
      if (width > el.clientWidth + 1) {
        const text = el.textContent.replace(/\s+/g, " ").trim().slice(0, 60);
        found.push(`${kind} ${width} px wide in a ${el.clientWidth} px box: ${JSON.stringify(text)}`);
      }
    }
  }
  return found;
})()"""

# Each line break inside a word of a table's code (a word: between spaces, ending after a slash or hyphen) whose
# characters would fit on one line of the box it wraps in (the code's own box, or its cell): a path or name broken
# where it need not be.
BROKEN_WORDS = r"""(() => {
  const found = [];
  for (const code of document.querySelectorAll("article table code")) {
    const chars = [];
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (let i = 0; i < node.length; i++) {
        const range = document.createRange();
        range.setStart(node, i);
        range.setEnd(node, i + 1);
        const rect = range.getBoundingClientRect();
        chars.push({ch: node.data[i], top: rect.top, width: rect.width});
      }
    }
    const box = getComputedStyle(code).display === "inline" ? code.closest("td, th") : code;  // where it wraps
    const style = getComputedStyle(box);
    const room = box.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    const ends = (c) => /[\s\/-]/.test(c.ch);  // a word may end after this character
    for (let i = 1; i < chars.length; i++) {
      const [before, after] = [chars[i - 1], chars[i]];
      if (ends(before) || /\s/.test(after.ch) || before.width === 0 || after.width === 0) continue;
      if (after.top <= before.top + 1) continue;  // no line break here
      let start = i - 1, end = i;
      while (start > 0 && !ends(chars[start - 1])) start--;
      while (end < chars.length - 1 && !ends(chars[end])) end++;
      if ((end - start + 1) * after.width <= room + 0.5) {
        const word = chars.slice(start, end + 1).map((c) => c.ch).join("");
        found.push(`table code broken mid-word: ${JSON.stringify(word.slice(0, 60))}`);
      }
    }
  }
  return found;
})()"""


def chromium_binary() -> str:
    """The path of Debian's chromium; a skip when there is none (a failure under CI, which installs it)."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    reason = ("no chromium on PATH: scripts/install.sh apt-installs Debian's chromium when it runs as root "
              "(MPI_FNAS_CHROMIUM=0 skips it), or `apt-get install chromium`")
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason}; CI installs it, so it must be there")
    pytest.skip(reason)


class Chromium:
    """A headless Chromium spoken to over ``--remote-debugging-pipe``, one command at a time."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_browser, self._to_browser = os.pipe()
        self._from_browser, from_browser = os.pipe()

        def browser_fds() -> None:  # in the child, before exec: the browser reads fd 3 and writes fd 4
            # copies above 4 first, in case a pipe end is fd 3 or 4 itself
            reads, writes = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5) for fd in (to_browser, from_browser))
            os.dup2(reads, 3)
            os.dup2(writes, 4)

        args = [binary, "--headless", "--remote-debugging-pipe", f"--user-data-dir={profile}",
                f"--window-size={WIDTH},{HEIGHT}", "--no-first-run", "--no-default-browser-check", "--disable-gpu",
                "--disable-extensions", "--disable-background-networking", "--mute-audio",
                # the site's own pages, offline: no sandbox, which refuses root and needs user namespaces
                "--host-resolver-rules=MAP * ~NOTFOUND", "--no-sandbox", "about:blank"]
        self._log = (profile / "chromium.log").open("wb")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     pass_fds=(3, 4), preexec_fn=browser_fds)
        os.close(to_browser)
        os.close(from_browser)
        self._pending = b""
        self._last_id = 0

    def _message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._pending:
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"chromium gave no answer in {ANSWER_SECONDS:.0f} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed its pipe (exit status {self.proc.poll()})")
            self._pending += chunk
        message, self._pending = self._pending.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        """The result of one DevTools command (to a page when `session` is its session id); events are skipped."""
        self._last_id += 1
        request: dict[str, Any] = {"id": self._last_id, "method": method, "params": params or {}}
        if session:
            request["sessionId"] = session
        os.write(self._to_browser, json.dumps(request).encode() + b"\0")
        deadline = time.monotonic() + ANSWER_SECONDS
        while True:
            message = self._message(deadline)
            if message.get("id") == self._last_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def wait_for(self, event: str, session: str) -> None:
        deadline = time.monotonic() + ANSWER_SECONDS
        while True:
            message = self._message(deadline)
            if message.get("method") == event and message.get("sessionId") == session:
                return

    def evaluate(self, expression: str, session: str) -> Any:
        """The value of a JavaScript expression in the page (a promise's, once settled)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> tuple[str, str]:
        """A new tab at `url`, 1280×800, loaded: its target id and session id."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False}, session)
        self.send("Page.enable", {}, session)
        self.send("Page.navigate", {"url": url}, session)
        self.wait_for("Page.loadEventFired", session)
        self.evaluate("document.fonts.ready.then(() => true)", session)
        return target, session

    def screenshot(self, session: str) -> bytes:
        """A PNG of the whole page, 1280 px wide."""
        height = self.evaluate("document.documentElement.scrollHeight", session)
        shot = self.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": 1}}, session)
        return base64.b64decode(shot["data"])

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):  # gone already: then it is closed
            self.send("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        self._log.close()
