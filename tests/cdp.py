"""A real headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``): stdlib only.

Chromium reads commands (JSON, each ended by a NUL byte) on fd 3 and writes answers and events on fd 4. No
websocket client, no driver binary, no download: Debian's ``chromium`` package is all it needs (``apt-get install
chromium``). Every wait is bounded in time.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """The first Chromium on PATH, or None."""
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class Browser:
    """One headless Chromium with one page (tab), closed by :meth:`close`."""

    def __init__(self, binary: str, *, width: int = 1280, height: int = 900) -> None:
        self._profile = tempfile.mkdtemp(prefix="csl-chromium-")
        to_chrome_r, to_chrome_w = os.pipe()
        from_chrome_r, from_chrome_w = os.pipe()
        # Out of the way of fds 3 and 4, which the child's ends are moved to.
        high_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
        high_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)

        def child_fds() -> None:
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",  # root in CI and containers
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=child_fds,  # noqa: PLW1509 - only dup2, before exec
            pass_fds=(3, 4),
        )
        for fd in (to_chrome_r, from_chrome_w, high_r, high_w):
            os.close(fd)
        self._out = os.fdopen(to_chrome_w, "wb", buffering=0)
        self._in = os.fdopen(from_chrome_r, "rb", buffering=0)
        self._ids = iter(range(1, 1 << 30))
        self._answers: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Page.enable", session=True)
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=True,
        )

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = self._in.read(65536)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._answers[-1] = {"error": {"message": "chromium closed the pipe"}}
                    self._cond.notify_all()
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" in message:
                    with self._cond:
                        self._answers[message["id"]] = message
                        self._cond.notify_all()

    def send(
        self, method: str, params: dict[str, Any] | None = None, *, session: bool = False, timeout: float = 30.0
    ) -> dict[str, Any]:
        """Send one command and wait (bounded) for its answer's ``result``."""
        n = next(self._ids)
        message: dict[str, Any] = {"id": n, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        self._out.write(json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while n not in self._answers and -1 not in self._answers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"chromium did not answer {method} within {timeout}s")
                self._cond.wait(left)
            answer = self._answers.pop(n, None) or self._answers[-1]
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error'].get('message')}")
        return dict(answer.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}, session=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails'].get('text')}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        """Poll a JavaScript expression until it is truthy (bounded in time and count); its last value."""
        value = None
        for _ in range(int(timeout / 0.1) + 1):
            with contextlib.suppress(RuntimeError):  # a page mid-navigation has no context for a moment
                value = self.evaluate(expression)
                if value:
                    return value
            time.sleep(0.1)
        return value

    def open(self, url: str, timeout: float = 20.0) -> None:
        """Navigate and wait until the new document has loaded."""
        self.send("Page.navigate", {"url": url}, session=True)
        self.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'", timeout)

    def screenshot(self, path: str) -> None:
        """A PNG of the whole page."""
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=True)
        with open(path, "wb") as out:
            out.write(base64.b64decode(data["data"]))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for stream in (self._out, self._in):
            with contextlib.suppress(OSError):
                stream.close()
        shutil.rmtree(self._profile, ignore_errors=True)
