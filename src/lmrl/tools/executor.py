"""Running one turn's tool calls together, each with a timeout.

The agent loop collects every row's call of a turn and hands them here at once. Calls are
grouped by tool; a tool gets its calls in one `Tool.call_batch` (the search tool scores all
queries in one pass), and the groups run side by side on a small thread pool. A group that
runs past ``timeout_s`` gives every one of its calls a ``timeout`` result and the turn goes
on (its thread is abandoned; the built-in ``python`` tool enforces its own limit inside a
process it kills, so nothing of it keeps running). The tools of a user's file that run in
worker processes (`ProcessTool`) go to their pool in one pass, beside the threads; there a
call past the timeout has its process killed. A tool that raises gives an ``error``
result whose text the policy sees as ``Error: <message>`` (a `ToolTimeout` gives a ``timeout``
one); nothing a tool does ends the run here. Each result says whether the tool was at fault
(`ToolResult.fault`), which the agent loop counts to stop a run whose tools are broken.

`CallsInFlight` runs turns in the background: `CallsInFlight.submit` hands a turn's calls to
`run_calls` on one of its threads and returns a future, so the agent loop decodes other rows
while they run (``rollout.multi_turn.pipeline_groups``). Its threads live as long as it does
(until `CallsInFlight.close`): the worker processes of a user's tools that a turn starts there
die with the thread that started them, so that thread must outlive them. Two turns in flight
reach one worker-process pool one after the other (`lmrl.tools.processes.run_in_pool` holds
the pool's lock), and the built-ins side by side.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmrl.tools.base import Tool, ToolError, ToolFault, ToolTimeout, error_text
from lmrl.tools.processes import ProcessTool, run_in_pool

__all__ = ["CallsInFlight", "ToolCall", "ToolResult", "is_fault", "run_calls"]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """A call's observation text and how it ended: ``ok``, ``error``, ``timeout`` or
    ``invalid`` (no such tool, or a call the format could not parse).

    ``fault`` is True when the tool failed whatever the call: a timeout, a `ToolFault`, or an
    exception other than a `ToolError` (a plain `ToolError` is the call's own fault: bad
    arguments, code that raised); a tool of a user's file run in a worker process answers
    which it was (``fault`` or ``error``, `lmrl.tools.processes`).
    """

    text: str
    status: str = "ok"
    fault: bool = False


def is_fault(err: BaseException) -> bool:
    """Whether an exception a tool raised is the tool's failure rather than the call's."""
    return isinstance(err, ToolFault) or not isinstance(err, ToolError)


def run_calls(
    calls: Sequence[ToolCall | ToolResult],
    tools: Mapping[str, Tool],
    timeout_s: float = 30.0,
    max_workers: int = 4,
) -> list[ToolResult]:
    """Run a turn's calls; one `ToolResult` per call, in order.

    Args:
        calls: parsed calls, or an already-made `ToolResult` (a call the format rejected)
            passed through as is.
        tools: name -> tool.
        timeout_s: wall-clock limit of each tool's group of calls in a thread (the tools in
            worker processes have their pool's own limit, set when they are loaded).
        max_workers: tools run at the same time.
    """
    results: list[ToolResult | None] = [None] * len(calls)
    groups: dict[str, list[int]] = {}
    for i, call in enumerate(calls):
        if isinstance(call, ToolResult):
            results[i] = call
        elif call.name not in tools:
            known = ", ".join(sorted(tools)) or "none"
            results[i] = ToolResult(
                f"Error: no tool named {call.name!r} (tools: {known})", "invalid"
            )
        else:
            groups.setdefault(call.name, []).append(i)
    if not groups:
        return [r for r in results if r is not None]

    def record(idx: list[int], outs: list[Any], answers: bool = False) -> None:
        """``answers``: ``outs`` are a worker process's ``(status, text)`` pairs."""
        if len(outs) != len(idx):
            outs = [RuntimeError(f"tool answered {len(outs)} of {len(idx)} calls")] * len(idx)
        for i, out in zip(idx, outs, strict=True):
            if answers:
                status = "error" if out[0] == "fault" else out[0]
                results[i] = ToolResult(out[1], status, fault=out[0] in ("fault", "timeout"))
            elif isinstance(out, BaseException):
                status = "timeout" if isinstance(out, ToolTimeout) else "error"
                results[i] = ToolResult(error_text(out), status, fault=is_fault(out))
            else:
                results[i] = ToolResult(out if isinstance(out, str) else str(out))

    remote = {n: idx for n, idx in groups.items() if isinstance(tools[n], ProcessTool)}
    local = {n: idx for n, idx in groups.items() if n not in remote}

    def run_group(name: str, idx: list[int]) -> list[str | BaseException]:
        return tools[name].call_batch([calls[i].arguments for i in idx])

    def run_remote() -> dict[str, list]:
        args = {n: [calls[i].arguments for i in idx] for n, idx in remote.items()}
        return run_in_pool(args, {n: tools[n] for n in remote})

    pool = cf.ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(local))))
    try:
        deadline = time.monotonic() + timeout_s
        futures = {pool.submit(run_group, name, idx): idx for name, idx in local.items()}
        # the worker processes keep their own clock and kill what runs past it; their pool
        # runs in this thread, which outlives them (a worker dies with the thread that
        # started it: PR_SET_PDEATHSIG)
        if remote:
            for name, outs in run_remote().items():
                record(remote[name], outs, answers=True)
        wait_s = max(0.0, deadline - time.monotonic())
        done, late = cf.wait(futures, timeout=wait_s) if futures else (set(), set())
        for future in done:
            try:
                outs = future.result()
            except Exception as err:  # call_batch itself failed: every call of the group
                outs = [err] * len(futures[future])
            record(futures[future], outs)
        for future in late:
            for i in futures[future]:
                name = calls[i].name
                results[i] = ToolResult(
                    f"Error: the {name} tool timed out after {timeout_s:g} s", "timeout", True
                )
    finally:
        # never wait for an abandoned call; its thread ends on its own
        pool.shutdown(wait=False, cancel_futures=True)
    return [r for r in results if r is not None]


class CallsInFlight:
    """Turns of calls run in the background, up to ``slots`` at once (see the module
    docstring).

    Args:
        tools: name -> tool.
        timeout_s, max_workers: as `run_calls`, for each turn.
        slots: turns in flight at once (the agent loop's groups).
    """

    def __init__(
        self, tools: Mapping[str, Tool], timeout_s: float, max_workers: int, slots: int
    ) -> None:
        self.tools, self.timeout_s, self.max_workers = tools, timeout_s, max_workers
        self.slots = max(1, slots)
        self._pool: cf.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, calls: Sequence[ToolCall | ToolResult]) -> cf.Future:
        """Start a turn's calls; a future of `run_calls`'s results (it never raises for a
        tool's failure: that is the call's result)."""
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.slots, thread_name_prefix="lmrl-tools")
            pool = self._pool
        return pool.submit(run_calls, list(calls), self.tools, self.timeout_s, self.max_workers)

    def close(self) -> None:
        """Stop the threads once their turns are done (a tool's own timeout bounds them)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
