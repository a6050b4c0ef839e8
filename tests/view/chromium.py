"""Debian's chromium, headless, for the browser tests and benchmarks/bench_view.py.

Two ways in, no dependency beyond the standard library:

* :func:`dump_dom`: ``chromium --headless --dump-dom URL``, the DOM after the page's scripts ran;
* :class:`Browser`: one chromium driven over the Chrome DevTools protocol on a pipe
  (``--remote-debugging-pipe``: JSON messages ending in NUL on file descriptors 3 and 4), to open
  pages, evaluate script, and move or click the real mouse (``Input.dispatchMouseEvent``).

A missing chromium is an error that says how to install it (``make test`` installs it), never a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

#: Flags of every launch: headless, no first-run work, nothing fetched from the network by chromium itself.
FLAGS = (
    "--headless",
    "--no-sandbox",  # tests run as root in CI containers
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--no-first-run",
    "--no-default-browser-check",
    "--mute-audio",
    "--window-size=1400,1000",
)


class ChromiumMissing(RuntimeError):
    pass


def executable() -> str:
    """Path of chromium (``$VERL_EXT_CHROMIUM``, else ``chromium`` on PATH); ChromiumMissing if none."""
    path = os.environ.get("VERL_EXT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise ChromiumMissing(
            "chromium is not installed: the browser tests need Debian's chromium "
            "(`make test` installs it; by hand: apt-get install -y chromium, or set VERL_EXT_CHROMIUM)"
        )
    return path


def dump_dom(url: str, timeout: float = 60.0, budget_ms: int | None = None) -> str:
    """The serialised DOM of ``url`` once its load event fired and its scripts ran."""
    with tempfile.TemporaryDirectory(prefix="verl-ext-chromium-") as profile:
        command = [executable(), *FLAGS, f"--user-data-dir={profile}", "--dump-dom"]
        if budget_ms is not None:
            command.append(f"--virtual-time-budget={budget_ms}")
        result = subprocess.run([*command, url], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 or "<html" not in result.stdout:
        raise RuntimeError(f"chromium --dump-dom {url} failed (exit {result.returncode}): {result.stderr[-2000:]}")
    return result.stdout


class ProtocolError(RuntimeError):
    pass


def _above(fd: int, minimum: int) -> int:
    """A duplicate of ``fd`` numbered ``minimum`` or more (``fd`` itself is closed)."""
    import fcntl

    duplicate = fcntl.fcntl(fd, fcntl.F_DUPFD, minimum)
    os.close(fd)
    return duplicate


class Browser:
    """One headless chromium; ``page()`` opens a tab. Use as a context manager, or call ``close()``.
    ``env``: variables set for chromium alone (e.g. FONTCONFIG_FILE: the fonts it may use)."""

    def __init__(self, timeout: float = 30.0, env: dict[str, str] | None = None):
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="verl-ext-chromium-")
        to_chrome_read, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_write = os.pipe()
        # the child's ends above 9, so that putting them on 3 and 4 cannot overwrite one with the other
        to_chrome_read, from_chrome_write = (_above(fd, 10) for fd in (to_chrome_read, from_chrome_write))
        # chromium reads commands on fd 3 and writes answers on fd 4 (bash: dash takes one-digit fds only)
        launch = f'exec "$0" "$@" 3<&{to_chrome_read} 4>&{from_chrome_write} {to_chrome_read}<&- {from_chrome_write}>&-'
        self._log = open(Path(self._profile) / "chromium.log", "wb")
        self.process = subprocess.Popen(
            [shutil.which("bash") or "/bin/bash", "-c", launch, executable(), *FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-pipe", "about:blank"],
            pass_fds=(to_chrome_read, from_chrome_write), stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
            env={**os.environ, **env} if env else None,
        )  # fmt: skip
        os.close(to_chrome_read)
        os.close(from_chrome_write)
        self._next_id = 0
        self._lock = threading.Lock()
        self._answers: dict[int, dict] = {}
        self._events: list[dict] = []
        self._arrived = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.version = self.send("Browser.getVersion")["product"]

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = os.read(self._from_chrome, 1 << 16)
            except OSError:
                data = b""
            if not data:
                with self._arrived:
                    self._closed = True
                    self._arrived.notify_all()
                return
            buffer += data
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                with self._arrived:
                    if "id" in message:
                        self._answers[message["id"]] = message
                    else:
                        self._events.append(message)
                    self._arrived.notify_all()

    _closed = False

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float | None = None) -> dict:
        """Send a command and wait for its answer; ProtocolError on an error answer."""
        with self._lock:
            self._next_id += 1
            ident = self._next_id
        message = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        try:
            os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise ProtocolError(f"chromium is not running (exit {self.process.poll()}); its log: {self.log()[-2000:]}") from None
        deadline = time.monotonic() + (timeout or self.timeout)
        with self._arrived:
            while ident not in self._answers:
                if self._closed:
                    raise ProtocolError(f"chromium exited while waiting for {method}; log: {self.log()[-2000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer to {method} within {timeout or self.timeout} s")
                self._arrived.wait(left)
            answer = self._answers.pop(ident)
        if "error" in answer:
            raise ProtocolError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def events(self, method: str, session: str | None = None) -> list[dict]:
        with self._arrived:
            return [e for e in self._events if e.get("method") == method and (session is None or e.get("sessionId") == session)]

    def page(self) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session, target)
        for domain in ("Page", "Runtime"):
            page.send(f"{domain}.enable")
        return page

    def log(self) -> str:
        try:
            return (Path(self._profile) / "chromium.log").read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send("Browser.close", timeout=5)
            except (ProtocolError, TimeoutError, OSError):
                pass
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()
        shutil.rmtree(self._profile, ignore_errors=True)


class Page:
    """One tab: navigate, evaluate, wait for a condition, hover and click like a user."""

    def __init__(self, browser: Browser, session: str, target: str):
        self.browser = browser
        self.session = session
        self.target = target

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})

    def send(self, method: str, params: dict | None = None, timeout: float | None = None) -> dict:
        return self.browser.send(method, params, self.session, timeout)

    def goto(self, url: str) -> None:
        """Open ``url`` and wait for its load event. When only the hash differs from the page shown,
        the hash is set instead (no load happens) after clearing the viewer's rendered markers."""
        here = self.evaluate("location.href")
        if "#" in url and here.split("#")[0] == url.split("#")[0] and not here.startswith("about:"):
            fragment = url.split("#", 1)[1]
            self.evaluate(
                "delete document.body.dataset.rendered; delete document.body.dataset.stats; "
                f"location.hash = {json.dumps(fragment)}; if (location.hash.slice(1) === {json.dumps(fragment)}) "
                "window.dispatchEvent(new HashChangeEvent('hashchange'))"
            )
            return
        before = len(self.browser.events("Page.loadEventFired", self.session))
        result = self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise ProtocolError(f"cannot open {url}: {result['errorText']}")
        self.wait(lambda: len(self.browser.events("Page.loadEventFired", self.session)) > before, f"the load of {url}")

    def evaluate(self, expression: str, timeout: float | None = None):
        """The value of a JavaScript expression (promises awaited); ProtocolError on an exception."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}, timeout)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise ProtocolError(f"{expression[:200]}: {details.get('exception', {}).get('description') or details.get('text')}")
        return result["result"].get("value")

    def wait(self, condition, what: str, timeout: float = 30.0):
        """Poll ``condition`` (a callable, or a JavaScript expression) until it is truthy."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition() if callable(condition) else self.evaluate(condition)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for {what}")
            time.sleep(0.01)

    def wait_rendered(self, step: int, sample: int, stats: bool = True, timeout: float = 30.0) -> None:
        """Wait until the viewer shows (step, sample) (and, with ``stats``, the step's statistics)."""
        condition = f"!!document.body && document.body.dataset.rendered === '{step}:{sample}'"
        if stats:
            condition += f" && document.body.dataset.stats === '{step}'"
        try:
            self.wait(condition, f"step {step}, sample {sample} on the page", timeout)
        except TimeoutError:
            error = self.evaluate("document.body && document.body.dataset.error || ''")
            raise TimeoutError(f"step {step}, sample {sample} not shown within {timeout} s; the page says: {error!r}") from None

    def centre(self, selector: str) -> tuple[float, float]:
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null; "
            "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect(); "
            "return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        if box is None:
            raise LookupError(f"no element matches {selector}")
        return box[0], box[1]

    def hover(self, selector: str) -> None:
        x, y = self.centre(selector)
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})

    def click(self, selector: str) -> None:
        x, y = self.centre(selector)
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})

    def select(self, selector: str, value: str) -> None:
        """Choose an option of a <select> as a user does (the change event fires)."""
        self.evaluate(
            f"(() => {{ const s = document.querySelector({json.dumps(selector)}); s.value = {json.dumps(value)}; "
            "s.dispatchEvent(new Event('change', {bubbles: true})); })()"
        )

    def dialogs(self) -> list[dict]:
        return self.browser.events("Page.javascriptDialogOpening", self.session)
