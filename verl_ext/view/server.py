"""The local server of the browser view (``verl-ext view TRACE``): the page, then the trace's data as
JSON, one step and one response at a time, read when the page asks for it.

Routes (GET and HEAD only; any other method is 405, any other path 404):

    /                                 the page, with the run's description inline (its script asks for the rest)
    /api/run                          the run (the trace is listed again: steps written since appear)
    /api/step?step=N                  the step's responses and their flags
    /api/sample?step=N&sample=S       one response, token by token
    /api/stats?step=N                 the step's summary, the estimators compared, its check failures and what it could not check
    /api/prompt?key=K                 where a prompt appears across steps

Read-only, and no URL names a file: every answer is computed from the trace the server was started
on, so nothing else on the machine can be reached (no path traversal, by construction). Bound to
127.0.0.1 by default; requests whose ``Host`` header is not a loopback name are refused then (a web
page elsewhere cannot read the trace through DNS rebinding). A step is read once and kept while it is
one of the :data:`CACHED_STEPS` most recently used, so moving between its responses reads nothing.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import socket
import sys
import threading
from collections import OrderedDict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from verl_ext.errors import TraceError, UsageError, one_line

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
#: Steps kept in memory (the one shown, and the one before).
CACHED_STEPS = 2
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
_log = logging.getLogger(__name__)


class NotFound(Exception):
    """A request for something the trace does not have (HTTP 404)."""


class BadRequest(Exception):
    """A malformed request (HTTP 400)."""


class ViewServer:
    """The server of one trace. ``serve_forever()`` runs it; ``shutdown()`` (from another thread)
    stops it; ``close()`` frees the port. ``url`` is the page's address."""

    def __init__(self, trace, decoder, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT):
        from verl_ext.view.page import render_page

        self.trace = trace
        self.decoder = decoder
        self._lock = threading.Lock()
        self._sources: OrderedDict[int, Any] = OrderedDict()
        self._step_locks: dict[tuple[str, int], threading.Lock] = {}
        self._stats: dict[int, dict] = {}
        self._prompt_index: dict[str, list[dict]] | None = None
        self._render_page = render_page
        self.check_host = _is_loopback(host)
        self.httpd = _bind(host, port, self)
        self.host = host
        self.port = self.httpd.server_address[1]

    @property
    def url(self) -> str:
        shown = DEFAULT_HOST if self.host in ("", "0.0.0.0", "::") else f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}/"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def shutdown(self) -> None:
        self.httpd.shutdown()

    def close(self) -> None:
        self.httpd.server_close()

    # ------------------------------------------------------------------ answers

    def answer(self, path: str, query: dict[str, list[str]]) -> tuple[str, bytes]:
        """(content type, body) of a GET; NotFound or BadRequest when there is none."""
        if path == "/":  # the page, with the run in it (one request less before the first response)
            page = self._render_page({"mode": "served", "run": self._run(query)}, f"verl-ext view · {self.trace.path}")
            return "text/html; charset=utf-8", page.encode()
        routes = {"/api/run": self._run, "/api/step": self._step, "/api/sample": self._sample, "/api/stats": self._statistics, "/api/prompt": self._prompt}
        if path not in routes:
            raise NotFound(f"no such page: {path} (the server answers /, /api/run, /api/step, /api/sample, /api/stats, /api/prompt)")
        body = json.dumps(routes[path](query), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return "application/json; charset=utf-8", body.encode()

    def _run(self, query) -> dict:
        from verl_ext.trace.reader import open_trace
        from verl_ext.view.payload import run_info

        with self._lock:
            self.trace = open_trace(self.trace.path)  # steps written since the server started appear
            return run_info(self.trace, self.decoder)

    def _step(self, query) -> dict:
        return self._source(_integer(query, "step")).overview()

    def _sample(self, query) -> dict:
        source = self._source(_integer(query, "step"))
        sample = _integer(query, "sample")
        try:
            source.require_sample(sample)
        except UsageError as error:
            raise NotFound(str(error)) from None
        return source.chunk([sample])

    def _statistics(self, query) -> dict:
        from verl_ext.check.run import check_trace
        from verl_ext.inspect.summary import summarize

        step = _integer(query, "step")
        with self._step_lock("stats", step):
            if step not in self._stats:
                source = self._source(step)
                summary = summarize(self.trace, [step]).to_pylist()[0]
                report = check_trace(self.trace, [step])
                self._stats[step] = source.statistics(summary, report)
            return self._stats[step]

    def _prompt(self, query) -> list[dict]:
        from verl_ext.inspect.unread import UnreadSteps
        from verl_ext.view.payload import prompt_key

        key = _text(query, "key")
        with self._step_lock("prompts", 0):
            if self._prompt_index is None:
                index: dict[str, list[dict]] = {}
                # a step whose prompt table does not read is not among the same prompt's steps (its own
                # request says why)
                for step, prompts in UnreadSteps().read(self.trace.steps, self.trace.prompts):
                    for sample, uid, ids in zip(*(prompts.column(n).to_pylist() for n in ("sample", "uid", "prompt_token_ids"))):
                        if ids is not None:
                            index.setdefault(prompt_key(ids), []).append({"step": step, "sample": sample, "uid": uid})
                self._prompt_index = index
        return self._prompt_index.get(key, [])

    def _source(self, step: int):
        """The step's StepSource, read once and kept while recently used."""
        from verl_ext.view.payload import StepSource

        if step not in self.trace.steps:
            raise NotFound(f"{self.trace.path} has no step {step} (steps on disk: {_listing(self.trace.steps)})")
        with self._lock:
            if step in self._sources:
                self._sources.move_to_end(step)
                return self._sources[step]
        with self._step_lock("source", step):
            with self._lock:
                if step in self._sources:
                    return self._sources[step]
            source = StepSource(self.trace, step, self.decoder)
            with self._lock:
                self._sources[step] = source
                while len(self._sources) > CACHED_STEPS:
                    self._sources.popitem(last=False)
            return source

    def _step_lock(self, kind: str, step: int) -> threading.Lock:
        with self._lock:
            return self._step_locks.setdefault((kind, step), threading.Lock())

    def host_allowed(self, header: str | None) -> bool:
        if not self.check_host:
            return True
        if not header:
            return False
        name = header.rsplit(":", 1)[0] if not header.endswith("]") else header
        return name.lower() in _LOOPBACK_NAMES or _is_loopback(name.strip("[]"))


def _integer(query: dict[str, list[str]], name: str) -> int:
    text = _text(query, name)
    try:
        return int(text)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {text!r}") from None


def _text(query: dict[str, list[str]], name: str) -> str:
    values = query.get(name)
    if not values:
        raise BadRequest(f"missing parameter {name}")
    return values[0]


def _listing(values) -> str:
    from verl_ext.trace.reader import listing

    return listing(list(values))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Handler(BaseHTTPRequestHandler):
    server_version = "verl-ext-view"
    protocol_version = "HTTP/1.1"
    view: ViewServer  # set on the subclass made per server

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._respond(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._respond(head=True)

    def _refuse_method(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, "application/json; charset=utf-8", _error("read-only: only GET and HEAD"), head=False, allow=True)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method  # noqa: N815

    def _respond(self, head: bool) -> None:
        if not self.view.host_allowed(self.headers.get("Host")):
            self._send(HTTPStatus.FORBIDDEN, "application/json; charset=utf-8", _error("this server answers requests to 127.0.0.1 or localhost only"), head)
            return
        parts = urlsplit(self.path)
        try:
            content_type, body = self.view.answer(parts.path, parse_qs(parts.query, keep_blank_values=True))
            status = HTTPStatus.OK
        except NotFound as error:
            status, content_type, body = HTTPStatus.NOT_FOUND, "application/json; charset=utf-8", _error(str(error))
        except BadRequest as error:
            status, content_type, body = HTTPStatus.BAD_REQUEST, "application/json; charset=utf-8", _error(str(error))
        except TraceError as error:
            status, content_type, body = HTTPStatus.NOT_FOUND, "application/json; charset=utf-8", _error(str(error))
        except Exception as error:  # noqa: BLE001 - one bad request must not stop the server
            print(f"verl-ext view: {self.path}: {type(error).__name__}: {one_line(error)}", file=sys.stderr)
            status, content_type, body = HTTPStatus.INTERNAL_SERVER_ERROR, "application/json; charset=utf-8", _error(one_line(error))
        self._send(status, content_type, body, head)

    def _send(self, status: HTTPStatus, content_type: str, body: bytes, head: bool, allow: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        if allow:
            self.send_header("Allow", "GET, HEAD")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet: the CLI prints the URL once
        pass


def _error(message: str) -> bytes:
    return json.dumps({"error": message}, ensure_ascii=False).encode()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that leaves before its answer is written (a closed tab, ``curl … | head``) is
        normal for a server a browser talks to: one debug line, not socketserver's traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):  # BrokenPipeError, ConnectionResetError, ConnectionAbortedError
            _log.debug("client %s went away: %s", client_address, error)
            return
        super().handle_error(request, client_address)


def _bind(host: str, port: int, view: ViewServer) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"view": view})
    server_class = type("Server", (_Server,), {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
    try:
        return server_class((host, port), handler)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is in use; choose another with --port (0 picks a free one)") from None
        raise UsageError(f"cannot serve on {host}:{port}: {error.strerror or one_line(error)}") from None


def serve(trace_or_path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, tokenizer=None) -> ViewServer:
    """A bound, not yet running, server of the trace (``serve_forever()`` runs it). ``tokenizer``: a
    TokenDecoder, a Hugging Face tokenizer or a path (default: the run record's). A port in use or
    an address that cannot be bound is a UsageError."""
    from verl_ext.steps.layout import as_trace
    from verl_ext.inspect.table import decoder_for

    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0 … 65535, got {port}")
    trace = as_trace(trace_or_path)
    return ViewServer(trace, decoder_for(trace, tokenizer), host, port)
