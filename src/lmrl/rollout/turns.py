"""The turns of the agent loop (`lmrl.rollout.agent`): one group of rows through its turns,
and the pipeline that keeps several groups' tool calls in flight while another decodes.

A `Group` is one session's rows. `Group.decode` samples one turn of its active rows and
returns the turn's calls; `Group.observe` takes their results, appends the observations to
the rows and to the session, and the group is ready to decode again.

`run_groups` drives the groups. With one group, a turn's calls run in this thread and are
awaited (the loop as it always was). With ``K`` groups (``rollout.multi_turn.pipeline_groups``)
a group's calls are handed to the tools' background threads (`lmrl.tools.CallsInFlight`) and
the next ready group decodes meanwhile; a group whose calls came back is ready again. So a
300 ms retriever costs the decoder nothing while another group has work to decode.

Why groups of separate sessions rather than rows joining one batch mid-turn: a group's
session sees the same calls in the same order whatever the timing (its own decodes and its own
observations), so its tokens, log-probs and masks do not depend on which group's tools answer
first; rows joining a shared decode would make the cache layout (and the last bits of the
logits) depend on the tools' timing.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lmrl.tools.executor import ToolCall, ToolResult

if TYPE_CHECKING:
    from lmrl.rollout.chat import Conversation

__all__ = ["OBS_CHARS_PER_TOKEN", "Group", "Row", "clip_text", "run_groups"]

#: characters of an observation kept per token it may keep, before tokenizing: generous
#: (English averages about 4 characters a token), so only a head averaging more than this
#: per token comes out shorter than ``max_obs_length`` tokens
OBS_CHARS_PER_TOKEN = 32


def clip_text(text: str, most: int | None) -> str:
    """``text`` cut to ``OBS_CHARS_PER_TOKEN`` characters per token of ``most`` (None = no
    cut), so a 5 MB passage is never tokenized whole; a lone surrogate (a JSON "\\ud800",
    bytes decoded with surrogateescape) cannot be tokenized: it becomes "?"."""
    text = text if most is None else text[: most * OBS_CHARS_PER_TOKEN]
    return text.encode("utf-8", "replace").decode("utf-8")


@dataclass
class Row:
    """One rollout row's response so far and its counters."""

    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    valid: int = 0
    errors: int = 0
    timeouts: int = 0
    obs_tokens: int = 0
    answered: bool = False
    done: bool = False


class Group:
    """The rows of one session through their turns (see the module docstring).

    Args:
        loop: the `lmrl.rollout.agent.AgentLoop` (its format, tools, tokenizer, ``max_turns``,
            ``max_obs_length``).
        session: the rows' session (``generate``, ``append``).
        count: its rows.
        budget: response tokens per row, observations included (``max_new_tokens``).
        stops: the stop strings of a turn.
        chats: the rows' conversations under the chat format, else None.
    """

    def __init__(
        self,
        loop,
        session,
        count: int,
        budget: int,
        stops: Sequence[str],
        chats: list[Conversation] | None = None,
    ) -> None:
        self.loop, self.session, self.chats = loop, session, chats
        self.budget, self.stops = budget, list(stops)
        self.rows = [Row() for _ in range(count)]
        self.turn = 0
        self.callers: list[int] = []  # the row of each call of the turn in flight
        self.calls: list[ToolCall | ToolResult] = []
        self.usage: dict[str, list[ToolResult]] = {}  # tool name -> its results, in order
        # called with the rows (indices) whose last turn just ended, once each; None = not
        self.on_done: Callable[[list[int]], None] | None = None
        self._reported: set[int] = set()

    @property
    def finished(self) -> bool:
        return self.turn > self.loop.max_turns or all(row.done for row in self.rows)

    def decode(self) -> list[ToolCall | ToolResult]:
        """Sample one turn of the active rows; the turn's calls (empty: the group is done)."""
        loop, rows, budget = self.loop, self.rows, self.budget
        active = [i for i, row in enumerate(rows) if not row.done]
        self.calls, self.callers = [], []
        if self.finished:
            self._report()
            return []
        asked = torch.zeros(len(rows), dtype=torch.bool)
        asked[active] = True
        left = torch.tensor([budget - len(row.tokens) for row in rows])
        outs = self.session.generate(asked, self.stops, left)
        last = self.turn == loop.max_turns
        for i in active:
            row, (tokens, lps, reason) = rows[i], outs[i]
            row.tokens += tokens
            row.sampled += [True] * len(tokens)
            row.log_probs += lps
            row.turns += 1
            if self.chats is not None:
                found = self.chats[i].assistant(tokens) if reason == "eos" else None
                if not found or last:
                    row.done, row.answered = True, found == []
                    continue
                if len(row.tokens) >= budget:
                    row.done = True
                    continue
                self.calls += found
                self.callers += [i] * len(found)
                continue
            text = loop.tokenizer.decode(tokens, skip_special_tokens=True)
            answered = text.rstrip().endswith(f"</{loop.format.answer_tag}>")
            if reason != "stop" or len(row.tokens) >= budget:
                row.done, row.answered = True, reason == "stop" and answered
                continue
            call = loop.format.parse(text, loop.tools)
            if call is None or last:
                row.done, row.answered = True, call is None and answered
                continue
            self.calls.append(call)
            self.callers.append(i)
        self.turn += 1
        self._report()
        return self.calls

    def observe(self, results: Sequence[ToolResult]) -> None:
        """The results of the calls `decode` returned: counted, wrapped, cut, tokenized,
        appended to their rows and fed to the session."""
        loop, budget = self.loop, self.budget
        answers: dict[int, list[str]] = {}
        for i, call, result in zip(self.callers, self.calls, results, strict=True):
            row = self.rows[i]
            row.calls += 1
            row.valid += result.status in ("ok", "error", "timeout")
            row.errors += result.status == "error"
            row.timeouts += result.status == "timeout"
            if isinstance(call, ToolCall) and call.name in loop.tools:
                self.usage.setdefault(call.name, []).append(result)
            answers.setdefault(i, []).append(result.text)
        observations = {}
        for i, texts in answers.items():
            row = self.rows[i]
            room = budget - len(row.tokens)
            if self.chats is not None:
                for text in texts:
                    loop.note_clipping(text)  # logs the first one cut by max_obs_length
                texts = [clip_text(t, loop.max_obs_length) for t in texts]
                ids = self.chats[i].observe(texts, loop.max_obs_length)[:room]
            else:
                if loop.max_obs_length is not None:
                    room = min(room, loop.max_obs_length)
                whole = loop.format.observation(texts[0])
                text = clip_text(whole, room)
                ids = loop.tokenizer.encode(text, add_special_tokens=False)
                loop.note_clipping(whole, len(ids) if len(text) == len(whole) else None)
                ids = ids[:room]
            row.tokens += ids
            row.sampled += [False] * len(ids)
            row.log_probs += [0.0] * len(ids)
            row.obs_tokens += len(ids)
            if len(row.tokens) >= budget:
                row.done = True  # no room left to answer
            else:
                observations[i] = ids
        self.calls, self.callers = [], []
        self.session.append(observations)
        self._report()

    def _report(self) -> None:
        """Hand ``on_done`` the rows whose last turn has ended (every row once the group is
        finished), each once."""
        if self.on_done is None:
            return
        final = self.finished
        new = [i for i, r in enumerate(self.rows) if (r.done or final) and i not in self._reported]
        if new:
            self._reported.update(new)
            self.on_done(new)


def run_groups(
    groups: Sequence[Group],
    run: Callable[[list[ToolCall | ToolResult]], list[ToolResult]],
    submit: Callable[[list[ToolCall | ToolResult]], cf.Future] | None = None,
) -> None:
    """Every turn of every group.

    Args:
        groups: the groups, each with its own session.
        run: runs a turn's calls in this thread (`lmrl.tools.run_calls` bound to the tools).
        submit: starts a turn's calls in the background, returning a future of their
            results; None (or a single group) = each turn's calls are run and awaited.
    """
    if submit is None or len(groups) == 1:
        for group in groups:
            while calls := group.decode():
                group.observe(run(calls))
        return
    ready = deque(groups)
    order = {group: k for k, group in enumerate(groups)}
    flying: dict[cf.Future, Group] = {}
    while ready or flying:
        # groups whose calls came back join the queue, in the order of the groups
        for future in sorted((f for f in flying if f.done()), key=lambda f: order[flying[f]]):
            group = flying.pop(future)
            group.observe(future.result())
            if not group.finished:
                ready.append(group)
        if ready:
            group = ready.popleft()
            if calls := group.decode():
                flying[submit(calls)] = group
        elif flying:
            cf.wait(flying, return_when=cf.FIRST_COMPLETED)
