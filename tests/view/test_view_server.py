"""The served view (``verl-ext view TRACE``): the same page fed step by step by a local read-only
server, in a real headless chromium; and the server's own guarantees over plain HTTP."""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest

from tests.view.view_helpers import NAN_AT, SCRIPT, TOKENS_JS, compare_tokens, parquet_tokens

pytestmark = pytest.mark.filterwarnings("ignore:One of rtol or atol is not valid:RuntimeWarning")  # the check of a NaN


def start(trace_path: str):
    from verl_ext.view import serve

    instance = serve(trace_path, port=0)
    threading.Thread(target=instance.serve_forever, daemon=True).start()
    return instance


def stop(instance) -> None:
    instance.shutdown()
    instance.close()


@pytest.fixture(scope="module")
def server(view_trace):
    """The server of the view trace on a free port, in a thread."""
    instance = start(view_trace)
    yield instance
    stop(instance)


def get(server, path: str, method: str = "GET", host: str | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one raw request (the path is sent exactly as given)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    connection.putheader("Host", host or f"127.0.0.1:{server.port}")
    connection.endheaders()
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response.status, dict(response.getheaders()), body


def test_steps_are_read_when_asked_for_and_once(view_trace, monkeypatch):
    from verl_ext.trace.reader import Trace

    reads: list[int] = []
    read_step = Trace.read_step

    def counting(self, step, columns=None):
        reads.append(step)
        return read_step(self, step, columns)

    monkeypatch.setattr(Trace, "read_step", counting)
    server = start(view_trace)
    try:
        assert reads == []  # opening the server reads no step
        status, _, body = get(server, "/api/run")
        assert status == 200 and json.loads(body)["steps"] == [1, 2, 3] and reads == []
        for path in ("/api/step?step=3", "/api/sample?step=3&sample=1", "/api/sample?step=3&sample=4", "/api/step?step=3"):
            assert get(server, path)[0] == 200
        assert reads == [3]  # one read of step 3 for its overview and every response of it
        chunk = json.loads(get(server, "/api/sample?step=3&sample=4")[2])
        assert chunk["samples"] == [4] and chunk["starts"] == [0, len(parquet_tokens(view_trace, 3, 4))]
        assert chunk["pieces"][0] == SCRIPT
    finally:
        stop(server)


def test_the_served_page_shows_the_trace(server, view_trace, page, long_samples):
    step, sample = NAN_AT[0], long_samples[0]
    page.send("Network.enable")
    page.goto(f"{server.url}#step={step}&sample={sample}")
    page.wait_rendered(step, sample)
    assert compare_tokens(page.evaluate(TOKENS_JS), view_trace, step, sample) == []
    other = long_samples[1]
    page.click(f"#sample-list a[data-sample='{other}']")
    page.wait_rendered(step, other)
    assert compare_tokens(page.evaluate(TOKENS_JS), view_trace, step, other) == []
    # the check of the step, computed on demand, points at the planted NaN
    failures = page.evaluate("[...document.querySelectorAll('#failures li')].map(li => [li.dataset.identity, li.dataset.sample, li.dataset.token])")
    assert ["finite", str(NAN_AT[1]), str(NAN_AT[2])] in failures
    assert page.evaluate("window.__pwned === undefined") and page.dialogs() == []
    # every request went to this server
    requested = {e["params"]["request"]["url"] for e in page.browser.events("Network.requestWillBeSent", page.session)}
    assert all(urlsplit(u).netloc == f"127.0.0.1:{server.port}" for u in requested), requested
    # the same prompt at the other steps, found by the server
    page.wait("document.querySelector('#across b') !== null", "the prompt across steps")
    assert {int(s) for s in page.evaluate("[...document.querySelectorAll('#across span[data-step]')].map(s => s.dataset.step)")} == {1, 3}


@pytest.mark.parametrize(
    "path",
    [
        "/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/_run.json", "/step=1/part-0.parquet", "/step-1/part-0.parquet", "/api/../_run.json",
        "/api/run/../../_run.json", "//etc/passwd", "/static/viewer.js", "/api/sample?step=1&sample=../../_run.json",
    ],
)  # fmt: skip
def test_no_file_can_be_reached(server, path):
    status, _, body = get(server, path)
    assert status in (400, 404), (path, status)
    assert b"root:" not in body and b"verl_ext_version" not in body and b"PAR1" not in body
    assert "error" in json.loads(body)


def test_read_only_and_loopback_only(server):
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, headers, _ = get(server, "/api/run", method)
        assert status == 405 and headers["Allow"] == "GET, HEAD", method
    assert get(server, "/api/run", host="evil.example:80")[0] == 403  # DNS rebinding
    assert get(server, "/", host=f"localhost:{server.port}")[0] == 200
    status, headers, body = get(server, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"default-src 'none'" in body
    assert get(server, "/", "HEAD")[2] == b""


def test_unknown_steps_and_samples_are_clear_errors(server):
    cases = {
        "/api/step?step=9": (404, "has no step 9 (steps on disk: 1, 2, 3)"),
        "/api/sample?step=2&sample=99": (404, "step 2 has no sample 99 (traced samples: 0, 1, 2, 3, 4, 5, 6, 7)"),
        "/api/sample?step=x&sample=1": (400, "step must be an integer, got 'x'"),
        "/api/stats": (400, "missing parameter step"),
    }
    for path, (status, message) in cases.items():
        got, _, body = get(server, path)
        assert got == status and message in json.loads(body)["error"], (path, body)


def test_the_command_serves_prints_the_url_and_stops_on_ctrl_c(view_trace):
    """`verl-ext view TRACE --port 0` in its own process: one line with the URL, then Ctrl-C: exit 0."""
    process = subprocess.Popen(
        [sys.executable, "-m", "verl_ext.cli", "view", view_trace, "--port", "0", "--step", "2", "--sample", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        line = process.stdout.readline()
        assert line.startswith(f"serving {view_trace} at http://127.0.0.1:") and "#step=2&sample=3" in line, line + process.stderr.read()
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/api/step?step=2")
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())  # read whole: leaving early is the next test's case
        connection.close()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        assert process.stderr.read() == ""
    finally:
        if process.poll() is None:
            process.kill()


def _leave(port: int, request: bytes) -> None:
    """A client that sends ``request`` (maybe nothing) and resets the connection at once (SO_LINGER 0)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.sendall(request)


def test_a_client_that_goes_away_is_silent(view_trace, capfd, caplog):
    """A closed tab or ``curl | head``: the server's read or write meets a reset connection. One debug
    line each, nothing on stderr (socketserver printed a traceback of ~20 lines per client), and the
    server goes on answering. A reset before the request is sent fails the server's read every time."""
    instance = start(view_trace)
    try:
        with caplog.at_level(logging.DEBUG, logger="verl_ext.view.server"):
            for _ in range(10):
                _leave(instance.port, b"")
                _leave(instance.port, f"GET /api/step?step=2 HTTP/1.1\r\nHost: 127.0.0.1:{instance.port}\r\n\r\n".encode())
            deadline = time.monotonic() + 30
            while len(caplog.records) < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            status, _, body = get(instance, "/api/step?step=2")
        went_away = [r for r in caplog.records if "went away" in r.getMessage()]
        assert len(went_away) >= 10 and len(went_away) == len(caplog.records), [r.getMessage() for r in caplog.records]
        assert status == 200 and json.loads(body)
    finally:
        stop(instance)
    assert capfd.readouterr().err == ""


def test_a_port_in_use_and_a_bad_start_are_one_line(view_trace, run_cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli("view", view_trace, "--port", str(port))
    assert code == 2 and out == ""
    assert err == f"verl-ext view: port {port} on 127.0.0.1 is in use; choose another with --port (0 picks a free one)\n"
    code, _, err = run_cli("view", view_trace, "--step", "7")
    assert code == 2 and err.count("\n") == 1 and "has no step 7" in err
    code, _, err = run_cli("view", view_trace, "--host", "203.0.113.9", "--port", "0")
    assert code == 2 and err.startswith("verl-ext view: cannot serve on 203.0.113.9:0: ") and err.count("\n") == 1


def test_a_step_that_does_not_read_is_its_own_error_and_the_others_are_served(tmp_path):
    """A step's prompt table cut short: the run says which step the record lists and the disk lacks, the
    cut step's requests answer 404 with the reader's one line naming its file, and every other step is
    served, the same prompt found at the steps that read."""
    import shutil

    import pyarrow.parquet as pq

    from tests.inspect.inspect_helpers import good_trace
    from verl_ext.trace.schema import prompt_file
    from verl_ext.view.payload import prompt_key

    path = good_trace(tmp_path / "t")
    first = pq.read_table(tmp_path / "t" / prompt_file(1)).column("prompt_token_ids")[0].as_py()
    (tmp_path / "t" / prompt_file(2)).write_bytes((tmp_path / "t" / prompt_file(2)).read_bytes()[:100])
    shutil.rmtree(tmp_path / "t" / "step-3")
    instance = start(path)
    try:
        status, _, body = get(instance, "/api/run")
        assert status == 200 and json.loads(body)["notes"] == ["step 3 is listed in the run record but missing on disk: left out"]
        status, _, body = get(instance, "/api/step?step=2")
        assert status == 404 and json.loads(body)["error"].startswith(f"{path}/{prompt_file(2)} is not a readable Parquet file")
        status, _, body = get(instance, "/api/step?step=1")
        assert status == 200 and json.loads(body)["step"] == 1
        status, _, body = get(instance, f"/api/prompt?key={prompt_key(first)}")
        assert status == 200 and {"step": 1, "sample": 0, "uid": "u0"} in json.loads(body)
    finally:
        stop(instance)
