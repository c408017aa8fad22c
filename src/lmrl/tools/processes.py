"""The tools of a user's file, run in worker processes with a timeout that kills.

A user's tool may hang, crash, leak or take the interpreter down with it; run in a thread of
the trainer, a call past its timeout can only be abandoned. With
``rollout.multi_turn.tool_processes >= 1`` (the default) the tools from ``tool_path`` run in a
`ToolPool`: the reward functions' process pool (`lmrl._procpool`) with tool tasks. A call past
``tool_timeout_s`` has its process killed and replaced and gets a ``timeout`` observation; a
process that dies (a segfault, ``os._exit``) gives its call an ``error`` observation naming the
exit code or signal; the other calls of the turn are answered as usual, timeouts in parallel.
A worker answers ``(status, text)``: ``fault`` where the tool failed whatever the call (a dead
worker, a `ToolFault`, an exception other than a `ToolError`), ``error`` for the call's own
`ToolError`, so the agent loop judges these tools as it judges the built-ins.

In the trainer a tool of the file is a `ProcessTool`: it keeps the tool's name, description
and schema, and its calls are tasks for the pool. Each worker imports the file itself and
makes its own copy of every tool (`_FileToolRunner` pickles as the file's path and the name).
A typed function's calls are one task each (one hanging call does not time out the others);
a `Tool` with its own ``call_batch`` gets a turn's calls as one task, as in-process.

The built-in tools stay in the trainer: ``search`` is our code over an index built once, and
``python`` already runs each piece of code in its own sandboxed process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmrl._procpool import ProcessPool
from lmrl._userfile import import_user_file
from lmrl.errors import ToolLoadError
from lmrl.tools.base import Tool, ToolError, ToolFault, ToolTimeout, error_text, user_tool

__all__ = ["ProcessTool", "ToolPool", "run_in_pool"]

Answer = tuple[str, str]  # (status: "ok" | "error" | "fault" | "timeout", observation text)


def _failed(err: BaseException) -> Answer:
    """A raised exception as an answer: ``fault`` unless it is the call's own `ToolError`."""
    if isinstance(err, ToolTimeout):
        return ("timeout", error_text(err))
    at_fault = isinstance(err, ToolFault) or not isinstance(err, ToolError)
    return ("fault" if at_fault else "error", error_text(err))


def _answer_one(tool: Tool, arguments: Mapping[str, Any]) -> Answer:
    try:
        out = tool(arguments)
    except Exception as err:  # the tool's failure is its observation
        return _failed(err)
    return ("ok", out if isinstance(out, str) else str(out))


class _FileToolRunner:
    """A worker's copy of the tool ``name`` of the file ``path``, pickled as (path, name).

    Unpickling imports the file and makes the tool, so a worker that cannot make it fails
    to start (the pool raises `ToolLoadError`) rather than answering every call with an
    error. ``call(("one", arguments))`` answers one call, ``call(("batch", [arguments,
    ...]))`` a list; nothing raises.
    """

    def __init__(self, path: str, name: str) -> None:
        self.path, self.name = path, name
        self.tool: Tool | None = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.path, self.name = state["path"], state["name"]
        module = import_user_file(self.path, "lmrl_user_tools")
        self.tool = user_tool(getattr(module, self.name), self.name)
        self.tool.name = self.name

    def call(self, task: tuple) -> Answer | list[Answer]:
        kind, payload = task
        if kind == "one":
            return _answer_one(self.tool, payload)
        try:
            outs = self.tool.call_batch(payload)
        except Exception as err:  # call_batch itself failed: every call of the group
            return [_failed(err)] * len(payload)
        if len(outs) != len(payload):
            text = f"Error: RuntimeError: tool answered {len(outs)} of {len(payload)} calls"
            return [("fault", text)] * len(payload)
        return [_failed(o) if isinstance(o, BaseException) else ("ok", str(o)) for o in outs]


class ToolPool(ProcessPool):
    """Worker processes running the tools of one file (see the module docstring).

    Args:
        path: the tool file.
        names: the names of the tools of that file to run.
        num_workers: processes (>= 1); more are started while calls look hung.
        timeout_s: seconds one task may run (one call, or one turn's calls of a batched tool).

    Raises:
        ToolLoadError: a worker cannot import the file or make a tool (raised by `run`).
    """

    what = "tool"
    load_error = ToolLoadError
    log = logging.getLogger("lmrl.tools")

    def __init__(self, path: str | Path, names: Sequence[str], num_workers: int, timeout_s: float):
        path = str(Path(path).expanduser().resolve())
        super().__init__([_FileToolRunner(path, n) for n in names], num_workers, timeout_s)
        self.index = {name: i for i, name in enumerate(names)}
        self.lock = threading.Lock()  # one run at a time: turns in flight take turns here

    def failure(self, task: tuple, status: str, message: str) -> Answer | list[Answer]:
        index, kind, payload = task
        if status == "timeout":
            name = self._names[index]
            text = f"Error: the {name} tool timed out after {self.timeout_s:g} s"
        else:  # its worker died
            status, text = "fault", f"Error: {message}"
        return [(status, text)] * len(payload) if kind == "batch" else (status, text)


def _exception(status: str, text: str) -> ToolError:
    """A worker's failed answer as the exception an in-process tool would have raised."""
    kind = {"timeout": ToolTimeout, "fault": ToolFault}.get(status, ToolError)
    return kind(text.removeprefix("Error: "))


class ProcessTool(Tool):
    """A tool of a user's file whose calls run in a `ToolPool`; it carries the tool's name,
    description and schema (from ``local``, the trainer's copy, which it does not keep)."""

    def __init__(self, local: Tool, pool: ToolPool) -> None:
        self.name, self.description = local.name, local.description
        self.parameters = local.parameters
        self.pool = pool
        self.batched = type(local).call_batch is not Tool.call_batch

    def tasks(self, calls: Sequence[Mapping[str, Any]]) -> list[tuple]:
        """The pool tasks for ``calls``: one per call, or one for all of a batched tool."""
        index = self.pool.index[self.name]
        if self.batched:
            return [(index, "batch", [dict(c) for c in calls])]
        return [(index, "one", dict(c)) for c in calls]

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        status, text = run_in_pool({self.name: [arguments]}, {self.name: self})[self.name][0]
        if status != "ok":
            raise _exception(status, text)
        return text

    def call_batch(self, calls: Sequence[Mapping[str, Any]]) -> list[str | BaseException]:
        answers = run_in_pool({self.name: list(calls)}, {self.name: self})[self.name]
        return [t if s == "ok" else _exception(s, t) for s, t in answers]

    def close(self) -> None:
        self.pool.close()


def run_in_pool(
    groups: Mapping[str, Sequence[Mapping[str, Any]]], tools: Mapping[str, ProcessTool]
) -> dict[str, list[Answer]]:
    """Run each named tool's calls in its pool, all of them in one pass per pool.

    Returns:
        name -> one ``(status, text)`` per call, in order.
    """
    by_pool: dict[int, list[str]] = {}
    for name in groups:
        by_pool.setdefault(id(tools[name].pool), []).append(name)
    answers: dict[str, list[Answer]] = {}
    for names in by_pool.values():
        pool = tools[names[0]].pool
        tasks = [tools[n].tasks(groups[n]) for n in names]
        with pool.lock:
            results = pool.run([t for per_tool in tasks for t in per_tool])
        at = 0
        for name, per_tool in zip(names, tasks, strict=True):
            got = results[at : at + len(per_tool)]
            at += len(per_tool)
            answers[name] = got[0] if tools[name].batched else got
    return answers
