"""The search tool against real local retrieval servers: every broken server is refused at
start-up in one line naming the URL; during a run a broken answer is a counted error
observation (`ToolFault`), never empty passages."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import lmrl.tools.search as search_module
from lmrl.errors import ToolLoadError
from lmrl.tools import SearchTool, ToolCall, ToolFault, ToolTimeout, load_tools, run_calls

GOOD = [{"document": {"contents": "Lumo\nLumo is a city."}, "score": 1.0}]


def handler(answer: Callable[[dict], tuple[int, str, bytes]]) -> type[BaseHTTPRequestHandler]:
    """A request handler whose ``answer(body) -> (status, content_type, bytes)``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, kind, data = answer(body)
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Handler


def json_answer(make: Callable[[list[str]], object]) -> Callable[[dict], tuple]:
    """A 200 JSON answer ``make(queries)``."""
    return lambda body: (200, "application/json", json.dumps(make(body["queries"])).encode())


@contextlib.contextmanager
def http_server(answer) -> Iterator[str]:
    """The URL of an HTTP server on 127.0.0.1 answering with ``answer`` (see `handler`)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(answer))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/retrieve"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def tcp_server(serve: Callable[[socket.socket, threading.Event], None]) -> Iterator[str]:
    """The URL of a TCP server on 127.0.0.1 whose thread runs ``serve(listener, stop)``;
    on exit ``stop`` is set and the listener closed."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(listener, stop), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/retrieve"
    finally:
        stop.set()
        listener.close()
        thread.join(2)


@contextlib.contextmanager
def raw_server(greeting: bytes | None) -> Iterator[str]:
    """A TCP server that sends ``greeting`` on accept (an SSH banner), or None: says nothing
    and never answers (a hung server); it holds each connection until it closes."""
    held: list[socket.socket] = []

    def serve(listener, stop):
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)
            if greeting is not None:
                conn.sendall(greeting)

    try:
        with tcp_server(serve) as url:
            yield url
    finally:
        for conn in held:
            conn.close()


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def down_server() -> Iterator[str]:
    yield f"http://127.0.0.1:{free_port()}/retrieve"


@contextlib.contextmanager
def trickle_server() -> Iterator[str]:
    """A server that sends a 200's headers, then its body a byte every 0.1 s (each read is
    quick: only a bound on the whole answer stops it)."""

    def serve(listener, stop):
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            while not stop.wait(0.1):
                conn.sendall(b" ")

    with tcp_server(serve) as url:
        yield url


@contextlib.contextmanager
def closing_server() -> Iterator[str]:
    """A server that reads the request and closes the connection without a word."""

    def serve(listener, stop):
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)

    with tcp_server(serve) as url:
        yield url


def not_utf8(body):
    return 200, "application/json", b'{"result": [["\xff\xfe caf\xe9"]]}'


BROKEN = {
    "down": (down_server, (), "cannot be reached"),
    "html": (
        http_server,
        (lambda body: (200, "text/html", b"<html><body>Welcome to nginx!</body></html>"),),
        "answered HTML, not JSON (text/html)",
    ),
    "http 500": (
        http_server,
        (lambda body: (500, "text/plain", b"internal error"),),
        "answered HTTP 500",
    ),
    "no result": (
        http_server,
        (json_answer(lambda qs: {"results": [GOOD for _ in qs]}),),
        "JSON without 'result' (keys ['results'])",
    ),
    "strings for hit lists": (
        http_server,
        (json_answer(lambda qs: {"result": ["a passage" for _ in qs]}),),
        "result[0] as a str, not a list of hits",
    ),
    "strings for hits": (
        http_server,
        (json_answer(lambda qs: {"result": [["a passage"] for _ in qs]}),),
        "result[0][0] as a str, not a hit",
    ),
    "a hit without text": (
        http_server,
        (json_answer(lambda qs: {"result": [[{"document": {"id": 3}}] for _ in qs]}),),
        "result[0][0] without a text",
    ),
    "not utf-8": (http_server, (not_utf8,), "bytes that are not UTF-8"),
    "ssh banner": (raw_server, (b"SSH-2.0-OpenSSH_8.9p1 Ubuntu-3\r\n",), "does not answer HTTP"),
    "hanging": (raw_server, (None,), "did not answer within 0.5 s"),
    "trickling": (trickle_server, (), "did not answer within 0.5 s"),
    "closing": (closing_server, (), "closed the connection without answering"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_server_is_refused_at_start_up_in_one_line(name):
    server, args, message = BROKEN[name]
    with server(*args) as url, pytest.raises(ToolLoadError) as caught:
        load_tools(["search"], options={"search": {"url": url, "probe_timeout_s": 0.5}})
    text = str(caught.value)
    assert text.startswith(f"the search tool: retrieval server {url} ")
    assert message in text and "start-up" in text
    assert "\n" not in text


def test_the_ssh_banner_is_quoted():
    banner = b"SSH-2.0-OpenSSH_8.9p1 Ubuntu-3\r\n"
    with raw_server(banner) as url, pytest.raises(ToolLoadError, match=r"it sent 'SSH-2\.0-"):
        SearchTool(url=url, probe_timeout_s=0.5)


def test_a_good_server_passes_the_probe_and_answers_each_query():
    seen = []

    def answer(body):
        seen.append(body)
        result = [
            [{"document": {"contents": f"T{q}\nabout {q}"}, "score": 1.0}] for q in body["queries"]
        ]
        return 200, "application/json", json.dumps({"result": result}).encode()

    with http_server(answer) as url:
        tool = SearchTool(url=url, topk=2)
        assert len(seen) == 1 and seen[0]["topk"] == 2  # the start-up query
        out = tool.call_batch([{"query": "alpha"}, {"query": "beta"}])
    assert out == ["Doc 1(Title: Talpha) about alpha", "Doc 1(Title: Tbeta) about beta"]
    assert len(seen) == 2 and seen[1]["queries"] == ["alpha", "beta"]  # a turn: one request


def test_text_and_title_and_bare_documents_are_hits_and_no_hits_is_no_results():
    def answer(body):
        docs = [[{"title": "T", "text": "plain"}, {"contents": "U\nbare"}], []]
        return 200, "application/json", json.dumps({"result": docs}).encode()

    with http_server(answer) as url:
        tool = SearchTool(url=url, probe_timeout_s=None)
        out = tool.call_batch([{"query": "a"}, {"query": "b"}])
    assert out == ["Doc 1(Title: T) plain\nDoc 2(Title: U) bare", "No results found."]


def test_a_malformed_hit_mid_run_is_a_counted_error_observation():
    """The server passes the start-up query, then answers strings: each call is an error
    observation naming the problem, and the tool's fault (never empty passages)."""
    calls = []

    def answer(body):
        calls.append(body)
        if len(calls) == 1:
            return json_answer(lambda qs: {"result": [GOOD for _ in qs]})(body)
        return json_answer(lambda qs: {"result": [["just a string"] for _ in qs]})(body)

    with http_server(answer) as url:
        tools = load_tools(["search"], options={"search": {"url": url}})
        out = run_calls(
            [ToolCall("search", {"query": "a"}), ToolCall("search", {"query": "b"})], tools
        )
    assert [r.status for r in out] == ["error", "error"] and all(r.fault for r in out)
    assert out[0].text.startswith(f"Error: retrieval server {url} answered result[0][0] as a str")
    # a query the policy left empty is the call's fault, not the tool's
    empty = run_calls([ToolCall("search", {"query": " "})], tools)[0]
    assert empty.status == "error" and not empty.fault


def test_a_server_that_stops_answering_mid_run_is_a_counted_timeout():
    with http_server(json_answer(lambda qs: {"result": [GOOD for _ in qs]})) as url:
        tool = SearchTool(url=url, timeout_s=0.3)
    with raw_server(None) as hung:
        tool.url = hung  # the same tool, now facing a server that never answers
        with pytest.raises(ToolTimeout, match=r"did not answer within 0\.3 s"):
            tool.retrieve(["x"])
        result = run_calls([ToolCall("search", {"query": "x"})], {"search": tool}, timeout_s=5)[0]
        tool.timeout_s = 5.0  # now the turn's limit comes first: the same timeout, counted
        late = run_calls([ToolCall("search", {"query": "x"})], {"search": tool}, timeout_s=0.3)[0]
    assert result.status == "timeout" and result.fault
    assert "did not answer within 0.3 s" in result.text
    assert late.status == "timeout" and late.fault and "timed out after 0.3 s" in late.text
    with down_server() as down:
        tool.url = down
        with pytest.raises(ToolFault, match="cannot be reached"):
            tool.retrieve(["x"])


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(ToolLoadError, match="starts with http"):
        load_tools(["search"], options={"search": {"url": "ftp://127.0.0.1/retrieve"}})


def test_an_answer_past_its_size_limit_is_refused(monkeypatch):
    monkeypatch.setattr(search_module, "MAX_ANSWER_BYTES", 2**20)
    big = {"result": [[{"document": {"contents": "T\n" + "x" * 2**20}}]]}
    with http_server(json_answer(lambda qs: big)) as url:
        with pytest.raises(
            ToolLoadError, match=rf"^retrieval server {re.escape(url)} answered more than 1 MiB"
        ):
            SearchTool(url=url, probe_timeout_s=2)
        tool = SearchTool(url=url, probe_timeout_s=None)
        with pytest.raises(ToolFault, match=r"^retrieval server .* answered more than 1 MiB$"):
            tool.retrieve(["x"])
