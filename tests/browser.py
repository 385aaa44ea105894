"""A real headless Chromium, driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON
messages ending in a NUL byte on the child's file descriptors 3 and 4), so a test can load a page, run
JavaScript in it and take a screenshot without a WebDriver or a websocket client."""

import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium() -> str | None:
    """The browser's executable, or None where none is installed (Debian: `apt-get install chromium`)."""
    return next((path for name in NAMES if (path := shutil.which(name))), None)


class Browser:
    """One headless browser with one page."""

    def __init__(self, executable: str, width: int = 1200, height: int = 900):
        commands, self._send = os.pipe()
        self._receive, answers = os.pipe()
        # The child's ends, above 3 and 4, become its fds 3 and 4 in a small Python that then runs the browser
        # (none of this process's Python runs in the forked child: this process has threads; a POSIX shell
        # names only fds 0-9).
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (commands, answers)]
        os.close(commands)
        os.close(answers)
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
                 f"--window-size={width},{height}", "about:blank"]
        start = (f"import os, sys; os.dup2({ends[0]}, 3); os.dup2({ends[1]}, 4); os.close({ends[0]}); "
                 f"os.close({ends[1]}); os.execv(sys.argv[1], sys.argv[1:])")
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # the tests' OpenBLAS: not the browser's
        self.proc = subprocess.Popen([sys.executable, "-c", start, executable, *flags], pass_fds=ends, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in ends:
            os.close(fd)
        self._buffer, self._next = b"", 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, session: str | None = None, **params) -> dict:
        """Send one command and return its result (events on the way are dropped)."""
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._send, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._receive, 1 << 16)
                if not chunk:
                    raise RuntimeError("the browser closed its DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._next:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]

    def open(self, url: str):
        self.call("Page.navigate", self.session, url=url)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", self.session, expression=expression, returnByValue=True)["result"]
        return result.get("value")

    def wait_for(self, expression: str, seconds: float = 30.0):
        """Until the expression is truthy in the page; its value."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if value := self.evaluate(expression):
                return value
            time.sleep(0.1)
        raise TimeoutError(f"the page never had {expression}")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", self.session, format="png")["data"])

    def close(self):
        try:
            self.call("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._send)
        os.close(self._receive)
