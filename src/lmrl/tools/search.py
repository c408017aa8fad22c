"""The ``search`` tool: BM25 over a local corpus, or a Search-R1-style retrieval server.

Corpus (``retriever.source``, a file): a parquet or JSONL file of passages, one per row, with
either ``contents`` (Search-R1's wiki dump: the title on the first line, the text after) or ``text``
and an optional ``title``. The index is built with ``bm25s`` (a maintained BM25 on numpy)
when the tool is made; building it is deterministic, so a resumed run rebuilds the same one.

Server (``retriever.source``, an http(s) URL): the request Search-R1's ``retrieval_server.py``
answers, ``POST {"queries": [...], "topk": k, "return_scores": true}`` with the answer
``{"result": [[{"document": {"contents": ...}, "score": ...}, ...], ...]}``, one list per
query. Every query of a turn goes in one request. The tool sends one query when it is made
and refuses (`ToolLoadError`, one line naming the URL) a server that is down, hangs (or
trickles its answer past the timeout: the timeout bounds the whole request, not each read), or
answers anything else: HTML, an HTTP error, bytes that are not UTF-8 JSON, another shape, more
than ``MAX_ANSWER_BYTES``.
During a run the same faults, and any malformed hit, are the call's `ToolFault` (an error
observation counted against the tool; no answer in time is a `ToolTimeout`), never empty
passages.

Both give the observation Search-R1 gives: ``Doc 1(Title: t) text`` lines, best first.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from lmrl.errors import ToolLoadError
from lmrl.tools.base import Tool, ToolError, ToolFault, ToolTimeout

__all__ = [
    "MAX_ANSWER_BYTES",
    "PROBE_TIMEOUT_S",
    "SearchTool",
    "format_passages",
    "load_corpus",
    "parse_answer",
]

#: seconds the start-up query to a retrieval server may take
PROBE_TIMEOUT_S = 10.0
#: bytes of one answer of a retrieval server (a turn's queries) beyond which it is refused:
#: far above Search-R1's (topk passages of ~1 kB per query)
MAX_ANSWER_BYTES = 64 * 2**20


def load_corpus(path: str | Path) -> list[dict[str, str]]:
    """Read passages as ``{"title", "text"}`` dicts from parquet or JSONL.

    Raises:
        ValueError: a missing or unreadable file, an unknown suffix, or rows with neither
            ``contents`` nor ``text`` (the message names the file and the columns found).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"retriever.source: no such file {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".jsonl", ".json"):
        raise ValueError(
            f"retriever.source {str(path)!r}: unknown format {suffix!r} (parquet or jsonl)"
        )
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        else:
            with path.open(encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
    except Exception as err:  # OSError, JSONDecodeError, pyarrow's own errors
        raise ValueError(f"retriever.source {str(path)!r} cannot be read: {err}") from None
    passages = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"retriever.source {str(path)!r} row {i} is not an object")
        if row.get("contents") is not None:
            title, _, text = str(row["contents"]).partition("\n")
        elif row.get("text") is not None:
            title, text = str(row.get("title") or ""), str(row["text"])
        else:
            raise ValueError(
                f"retriever.source {str(path)!r} row {i} has neither 'contents' nor 'text' "
                f"(columns: {sorted(row)})"
            )
        passages.append({"title": title, "text": text})
    if not passages:
        raise ValueError(f"retriever.source {str(path)!r} holds no passages")
    return passages


def format_passages(passages: Sequence[Mapping[str, str]]) -> str:
    """Search-R1's observation text: ``Doc i(Title: title) text`` per passage, best first."""
    if not passages:
        return "No results found."
    return "\n".join(
        f"Doc {i}(Title: {p.get('title', '')}) {p.get('text', '')}"
        for i, p in enumerate(passages, 1)
    )


class SearchTool(Tool):
    """Retrieve the ``topk`` passages best matching a query.

    Args:
        corpus: a passages file (see `load_corpus`), or the passages themselves.
        url: a retrieval server instead of a local corpus (exactly one of the two).
        topk: passages per query (``retriever.topk``).
        timeout_s: the server request's timeout.
        probe_timeout_s: with ``url``, the timeout of the query sent when the tool is made
            (`probe`); None = no query.

    Raises:
        ValueError: both or neither of corpus and url, a bad ``topk``, an unreadable corpus.
        ToolLoadError: the server failed the start-up query.
    """

    name = "search"
    description = "Search the knowledge base; returns the most relevant passages."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to search for"}},
        "required": ["query"],
    }

    def __init__(
        self,
        corpus: str | Path | Sequence[Mapping[str, str]] | None = None,
        url: str | None = None,
        topk: int = 3,
        timeout_s: float = 30.0,
        probe_timeout_s: float | None = PROBE_TIMEOUT_S,
    ) -> None:
        if (corpus is None) == (url is None):
            raise ValueError(
                "the search tool needs exactly one of corpus (a local passages file) and url "
                "(a retrieval server): retriever.source"
            )
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"retriever.topk must be an int >= 1, got {topk!r}")
        self.topk, self.url, self.timeout_s = topk, url, timeout_s
        self.passages: list[dict[str, str]] = []
        if corpus is not None:
            self.passages = (
                load_corpus(corpus) if isinstance(corpus, str | Path) else [dict(p) for p in corpus]
            )
            self._build_index()
        elif not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever.source {url!r}: a server's URL starts with http(s)://")
        elif probe_timeout_s is not None:
            self.probe(probe_timeout_s)

    def _build_index(self) -> None:
        import bm25s
        from bm25s.tokenization import Tokenizer

        # bm25s sets its logger to DEBUG on import, which prints a line per index built
        logging.getLogger("bm25s").setLevel(logging.WARNING)

        self._tokenizer = Tokenizer(stopwords="en")
        texts = [f"{p['title']} {p['text']}" for p in self.passages]
        ids = self._tokenizer.tokenize(
            texts, update_vocab=True, return_as="ids", show_progress=False
        )
        self._index = bm25s.BM25()
        self._index.index(ids, show_progress=False)

    # ---------------------------------------------------------------------- calls
    @staticmethod
    def _query(arguments: Mapping[str, Any]) -> str:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ToolError("search needs a non-empty query")
        return query.strip()

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        out = self.call_batch([arguments])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def call_batch(self, calls: Sequence[Mapping[str, Any]]) -> list[str | BaseException]:
        out: list[str | BaseException] = [ToolError("unanswered")] * len(calls)
        queries, where = [], []
        for i, arguments in enumerate(calls):
            try:
                queries.append(self._query(arguments))
                where.append(i)
            except ToolError as err:
                out[i] = err
        if queries:
            found = self.retrieve(queries)
            for i, passages in zip(where, found, strict=True):
                out[i] = format_passages(passages)
        return out

    def retrieve(self, queries: Sequence[str]) -> list[list[dict[str, str]]]:
        """The ``topk`` passages of every query, best first (zero-score matches dropped).

        Raises:
            ToolFault: the server cannot be reached or answers in another shape
                (`ToolTimeout`: not in time).
        """
        if self.url is not None:
            return self._remote(queries)
        ids = self._tokenizer.tokenize(
            list(queries), update_vocab=False, return_as="ids", show_progress=False
        )
        k = min(self.topk, len(self.passages))
        docs, scores = self._index.retrieve(ids, k=k, show_progress=False, n_threads=1)
        return [
            [self.passages[int(d)] for d, s in zip(row_d, row_s, strict=True) if s > 0]
            for row_d, row_s in zip(docs, scores, strict=True)
        ]

    def _remote(
        self, queries: Sequence[str], timeout_s: float | None = None
    ) -> list[list[dict[str, str]]]:
        """One request for every query; the answer checked hit by hit.

        Raises:
            ToolTimeout: no answer within ``timeout_s`` (default: the tool's ``timeout_s``).
            ToolFault: the server cannot be reached, answers an HTTP error, something that is
                not UTF-8 JSON, or JSON of another shape (the message names the URL and what
                is wrong).
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        who = f"retrieval server {self.url}"
        body = json.dumps({"queries": list(queries), "topk": self.topk, "return_scores": True})
        request = urllib.request.Request(
            self.url,
            data=body.encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        deadline = time.monotonic() + timeout_s
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                kind = response.headers.get("Content-Type") or "no Content-Type"
                raw = _read_body(response, deadline, who)
        except urllib.error.HTTPError as err:
            raise ToolFault(f"{who} answered HTTP {err.code} ({err.reason})") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                raise ToolTimeout(f"{who} did not answer within {timeout_s:g} s") from None
            raise ToolFault(f"{who} cannot be reached: {err.reason}") from None
        except TimeoutError:
            raise ToolTimeout(f"{who} did not answer within {timeout_s:g} s") from None
        except ConnectionResetError:  # http.client.RemoteDisconnected too; before OSError
            # a close with the request still unread reaches the client as a reset
            raise ToolFault(f"{who} closed the connection without answering") from None
        except http.client.HTTPException as err:  # a status line that is not HTTP's
            first = str(err.args[0] if err.args else err).strip()[:60]
            raise ToolFault(f"{who} does not answer HTTP (it sent {first!r})") from None
        except (OSError, ValueError) as err:  # a reset connection; a URL urllib cannot use
            raise ToolFault(f"{who} failed: {err}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ToolFault(
                f"{who} answered bytes that are not UTF-8 ({err.reason} at byte {err.start})"
            ) from None
        try:
            answer = json.loads(text)
        except json.JSONDecodeError:
            what = "HTML" if "html" in kind.lower() or text.lstrip()[:1] == "<" else "text"
            raise ToolFault(
                f"{who} answered {what}, not JSON ({kind}): {text.strip()[:60]!r}"
            ) from None
        try:
            return parse_answer(answer, len(queries))
        except ValueError as err:
            raise ToolFault(f"{who} answered {err}") from None

    def probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        """Send the server one query and check its answer, as a run starts.

        Raises:
            ToolLoadError: the server is down, hangs, or answers anything but Search-R1's
                shape (the message names the URL and what was wrong).
        """
        outcome: list[BaseException | None] = []

        def ask() -> None:
            try:
                self._remote(["lmrl start-up check"], timeout_s)
                outcome.append(None)
            except BaseException as err:  # handed to the caller's thread
                outcome.append(err)

        # in a thread of its own, so that no stage of the request (a name lookup, headers
        # sent a byte at a time) holds start-up past the timeout
        thread = threading.Thread(target=ask, name="lmrl-retriever-probe", daemon=True)
        thread.start()
        thread.join(timeout_s + 0.5)
        if not outcome:
            err: BaseException = ToolTimeout(
                f"retrieval server {self.url} did not answer within {timeout_s:g} s"
            )
        else:
            err = outcome[0]
        if isinstance(err, ToolFault):
            raise ToolLoadError(
                f"{err} (one query sent at start-up; start the server or fix retriever.source)"
            ) from None
        if err is not None:
            raise err


def _read_body(response: http.client.HTTPResponse, deadline: float, who: str) -> bytes:
    """The answer's bytes, read as they come, by ``deadline`` (`time.monotonic`).

    The socket's timeout bounds each read; this bounds the whole answer, which a server
    sending a byte at a time would otherwise stretch without end.

    Raises:
        TimeoutError: past ``deadline``.
        ToolFault: more than ``MAX_ANSWER_BYTES``.
    """
    chunks, size = [], 0
    while chunk := response.read1(2**16):
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise ToolFault(f"{who} answered more than {MAX_ANSWER_BYTES // 2**20} MiB")
        if time.monotonic() > deadline:
            raise TimeoutError
        chunks.append(chunk)
    return b"".join(chunks)


def parse_answer(answer: Any, count: int) -> list[list[dict[str, str]]]:
    """Passages from a Search-R1 server's answer to ``count`` queries.

    Args:
        answer: the decoded JSON, ``{"result": [[hit, ...], ...]}``, one hit list per query;
            a hit is ``{"document": {"contents": "title\\ntext"}, "score": s}``, or the
            document itself (``return_scores=false``); ``text`` (+ ``title``) may stand for
            ``contents``.
        count: queries sent.

    Returns:
        per query, its passages as ``{"title", "text"}``, in the server's order.

    Raises:
        ValueError: any other shape (the message says where, e.g. ``result[0][1]``).
    """
    if not isinstance(answer, Mapping) or "result" not in answer:
        keys = f"keys {sorted(answer)}" if isinstance(answer, Mapping) else _kind(answer)
        raise ValueError(f"JSON without 'result' ({keys}); expected {{'result': [[hit, ...]]}}")
    result = answer["result"]
    if not isinstance(result, list):
        raise ValueError(f"'result' as {_kind(result)}, not one list of hits per query")
    if len(result) != count:
        raise ValueError(f"{len(result)} hit lists in 'result' for {count} queries")
    out = []
    for q, hits in enumerate(result):
        if not isinstance(hits, list):
            raise ValueError(f"result[{q}] as {_kind(hits)}, not a list of hits")
        passages = []
        for k, hit in enumerate(hits):
            doc = hit.get("document", hit) if isinstance(hit, Mapping) else hit
            if not isinstance(doc, Mapping):
                where = f"result[{q}][{k}]" + ("['document']" if doc is not hit else "")
                raise ValueError(
                    f"{where} as {_kind(doc)}, not a hit "
                    "({'document': {'contents': ...}, 'score': ...})"
                )
            contents, text = doc.get("contents"), doc.get("text")
            if isinstance(contents, str):
                title, _, text = contents.partition("\n")
            elif contents is None and isinstance(text, str):
                title = doc.get("title")
                title = title if isinstance(title, str) else ""
            else:
                raise ValueError(
                    f"result[{q}][{k}] without a text: its document needs a string 'contents' "
                    f"(or 'text'), has keys {sorted(doc)}"
                )
            passages.append({"title": title, "text": text})
        out.append(passages)
    return out


def _kind(value: Any) -> str:
    """``a str``, ``a list``, ``null``: what a value is, for the messages."""
    name = type(value).__name__
    return "null" if value is None else f"a{'n' if name[0] in 'aeiou' else ''} {name}"
