"""Headless Chromium for the page tests, driven over the DevTools protocol through a pipe (standard library only).

Chromium comes from Debian's packages: :func:`find_chromium` installs it as root when it is missing (``apt-get
install chromium``) and otherwise tells why the test cannot run (the tests skip then, but fail in CI).

Example::

    with Chromium(tmp_path) as browser:
        page = browser.open("http://127.0.0.1:8080/")
        page.wait_for("document.querySelectorAll('tr.peer').length >= 3", timeout=30)
        page.screenshot(tmp_path / "page.png")
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _which() -> str | None:
    return next((path for path in map(shutil.which, CANDIDATES) if path), None)


def find_chromium() -> tuple[str | None, str]:
    """Chromium's executable (installed from Debian's packages first when missing and this runs as root), or
    ``None`` and why not."""
    found = _which()
    if found:
        return found, ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "headless Chromium is needed (as root the test installs it: apt-get install chromium)"
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600)
    install = subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], capture_output=True, text=True,
                             timeout=900)
    found = _which()
    return (found, "") if found else (None, f"apt-get install chromium failed: {install.stderr[-500:]}")


class Chromium:
    """A headless Chromium process; its DevTools protocol runs over fds 3 and 4 (``--remote-debugging-pipe``)."""

    def __init__(self, tmp_path: Path, executable: str | None = None, size: tuple[int, int] = (1280, 900)):
        executable = executable or find_chromium()[0]
        if executable is None:
            raise RuntimeError("no Chromium")
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()
        args = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
                f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--window-size={size[0]},{size[1]}",
                "--remote-debugging-pipe", "about:blank"]
        # the protocol wants its pipes as fds 3 (commands in) and 4 (replies out)
        # (through fds 10 and 11: the pipes may themselves be fds 3 or 4)
        script = (f'exec 10<&{to_browser_read} 11>&{from_browser_write}; exec 3<&10 4>&11; exec 10<&- 11>&-; '
                  'exec "$@"')
        self.log_path = tmp_path / "chromium.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(["bash", "-c", script, "chromium", *args],
                                         pass_fds=(to_browser_read, from_browser_write), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(to_browser_read)
        os.close(from_browser_write)
        self.size = size
        self._ids = itertools.count(1)
        self._replies: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        with os.fdopen(self._from_browser, "rb", buffering=0) as pipe:
            while True:
                chunk = pipe.read(65536)
                if not chunk:
                    break
                buffer += chunk
                *messages, buffer = buffer.split(b"\0")
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        with self._cond:
                            self._replies[message["id"]] = message
                            self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict[str, Any]:
        """One DevTools command; its result (raises on an error reply)."""
        message_id = next(self._ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while message_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(f"no reply to {method} (Chromium log: {self.log_path})")
                self._cond.wait(min(left, 0.5))
            reply = self._replies.pop(message_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def open(self, url: str) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.size[0], "height": self.size[1],
                                                         "deviceScaleFactor": 1, "mobile": False}, session)
        self.send("Page.navigate", {"url": url}, session)
        return page

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close", timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)
        os.close(self._to_browser)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Page:
    def __init__(self, browser: Chromium, session: str):
        self.browser, self.session = browser, session

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                   self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, poll: float = 0.25) -> Any:
        """Wait until ``expression`` is truthy in the page; its value (raises TimeoutError with the last one)."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None  # e.g. while the page loads
            if value:
                return value
            time.sleep(poll)
        raise TimeoutError(f"{expression!r} stayed {value!r} for {timeout} s")

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """Save a PNG of the page (the whole page, not only the window, by default)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            height = int(self.evaluate("document.body.scrollHeight") or self.browser.size[1])
            params["clip"] = {"x": 0, "y": 0, "width": self.browser.size[0], "height": height, "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.browser.send("Page.captureScreenshot", params, self.session)["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path
