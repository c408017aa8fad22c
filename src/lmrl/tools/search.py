"""The ``search`` tool: BM25 over a local corpus, or a Search-R1-style retrieval server.

Corpus (``retriever.source``, a file): a parquet or JSONL file of passages, one per row, with
either ``contents`` (Search-R1's wiki dump: the title on the first line, the text after) or ``text``
and an optional ``title``. The index is built with ``bm25s`` (a maintained BM25 on numpy)
when the tool is made; building it is deterministic, so a resumed run rebuilds the same one.

Server (``retriever.source``, an http(s) URL): the request Search-R1's ``retrieval_server.py``
answers, ``POST {"queries": [...], "topk": k, "return_scores": true}`` with the answer
``{"result": [[{"document": {"contents": ...}, "score": ...}, ...], ...]}``, one list per
query. Every query of a turn goes in one request.

Both give the observation Search-R1 gives: ``Doc 1(Title: t) text`` lines, best first.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from lmrl.tools.base import Tool, ToolError

__all__ = ["SearchTool", "format_passages", "load_corpus"]


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
            ToolError: the server cannot be reached or answers in another shape.
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

    def _remote(self, queries: Sequence[str]) -> list[list[dict[str, str]]]:
        body = json.dumps({"queries": list(queries), "topk": self.topk, "return_scores": True})
        request = urllib.request.Request(
            self.url, data=body.encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read().decode())
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as err:
            raise ToolError(f"retrieval server {self.url} failed: {err}") from None
        result = answer.get("result") if isinstance(answer, Mapping) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise ToolError(
                f"retrieval server {self.url} answered without a 'result' list of "
                f"{len(queries)} entries"
            )
        out = []
        for hits in result:
            passages = []
            for hit in hits or []:
                doc = hit.get("document", hit) if isinstance(hit, Mapping) else {}
                contents = doc.get("contents")
                if contents is None:
                    passages.append({"title": doc.get("title", ""), "text": doc.get("text", "")})
                else:
                    title, _, text = str(contents).partition("\n")
                    passages.append({"title": title, "text": text})
            out.append(passages)
        return out
