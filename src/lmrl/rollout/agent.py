"""Multi-turn rollouts with tools (Search-R1): generate, call tools, append, continue.

`AgentLoop` wraps any engine and is itself a `RolloutEngine`. For a batch of ``B * n`` rows:

1. every active row samples until a tool's closing tag, the answer's closing tag, EOS, or its
   token budget (``max_new_tokens`` counts all response tokens, observations included);
2. the turn's text is parsed by the call format: an answer or EOS ends the row; a tool call
   joins the turn's calls, which run together (`lmrl.tools.run_calls`, grouped per tool,
   with a timeout); a closing tag around nothing valid gets an error observation;
3. each observation is wrapped (``<information>...</information>`` for Search-R1), cut to
   ``OBS_CHARS_PER_TOKEN`` characters per token it may keep (so a 5 MB passage is never
   tokenized whole), made valid UTF-8 (a lone surrogate becomes ``?``), tokenized, cut to
   ``max_obs_length`` tokens and to the row's remaining budget, and appended; the first
   observation cut by ``max_obs_length`` is logged once (its size, the limit and the key);
4. repeat; after ``max_turns`` observations a row gets one last turn in which calls are not
   run (its closing tag ends it), as Search-R1's final rollout.

The turns themselves are `lmrl.rollout.turns`: with ``pipeline_groups=K > 1`` the rows of a
micro-batch are split into ``K`` groups, each its own session, and a group's calls run in the
background (`lmrl.tools.CallsInFlight`) while the next group decodes; a group's tokens do not
depend on when its or another group's calls return (docs/async.md). ``K=1`` is the plain loop
above: all rows decode, then the turn's calls run and are awaited.

With ``format="chat"`` (`lmrl.rollout.chat`) a turn ends at its end-of-turn token, may call
several tools (in the chat template's own syntax), and what is appended is the template's
rendering of the tool messages and the next generation prompt (a delta of the whole
conversation's tokens, checked at start-up by `check_template`).

The KV cache is kept across turns: an engine with ``open_session`` (``hf``) appends each
observation to the cache with one forward. Any other engine (``vllm``) is driven through
`ReplaySession`, which re-sends each row's whole context every turn (vLLM's prefix cache
then skips the recomputation).

Output: the engine layout of `lmrl.rollout.base`, with the observations inside
``responses`` in order; ``attention_mask`` is True on every real token; ``response_mask``
is True on sampled tokens only when ``state_masking`` (Search-R1's ``info_mask``), on all
real tokens otherwise; ``rollout_log_probs`` are 0 on observations. Per-row counters for the
metrics: ``agent_turns``, ``agent_tool_calls``, ``agent_valid_calls``, ``agent_tool_errors``,
``agent_tool_timeouts``, ``agent_obs_tokens``, ``agent_answered`` (float tensors (B*n,)).

Broken tools stop the run, as broken rewards do (``reward.max_error_fraction``): the first
rollout in which a tool gets at least ``MIN_CHECKED_CALLS`` calls checks it once, and a tool
at fault (`lmrl.tools.executor.ToolResult.fault`: a timeout, a server down or answering
garbage, an exception other than a `ToolError`) on at least ``max_tool_error_fraction`` of
them raises `lmrl.errors.ToolRunError` naming the tool, the fraction and the first error.
Errors that are the call's own (bad arguments, the policy's code that raised) never stop it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from lmrl.batch import Batch
from lmrl.batch.schema import keys as schema_keys
from lmrl.errors import ToolRunError
from lmrl.rollout.base import (
    CallSeeds,
    EngineView,
    RolloutEngine,
    RowDone,
    SamplingParams,
    check_prompts,
    finish_rollout,
)
from lmrl.rollout.chat import ChatFormat
from lmrl.rollout.turns import OBS_CHARS_PER_TOKEN, Group, Row, clip_text, run_groups
from lmrl.tools.base import Tool
from lmrl.tools.executor import CallsInFlight, ToolCall, ToolResult, run_calls

__all__ = [
    "AGENT_KEYS",
    "FORMATS",
    "OBS_CHARS_PER_TOKEN",
    "AgentLoop",
    "ChatFormat",
    "JsonFormat",
    "ReplaySession",
    "TagFormat",
    "clip_text",
]

log = logging.getLogger("lmrl.tools")

#: calls of one tool in one rollout before its failures are judged (the first batch check)
MIN_CHECKED_CALLS = 5

#: per-row counters (float (B,)), in the order `generate` writes `Row`'s fields
AGENT_KEYS = schema_keys(group="agent")


# ---------------------------------------------------------------------------- formats
class TagFormat:
    """Search-R1's format: ``<search>query</search>``, ``<python>code</python>``; the answer
    in ``<answer>...</answer>``; observations as ``<information>...</information>``.

    A tag's text fills the tool's main argument (`Tool.main_argument`).
    """

    name = "search_r1"

    def __init__(self, answer_tag: str = "answer", observation_tag: str = "information"):
        self.answer_tag, self.observation_tag = answer_tag, observation_tag

    def stops(self, tools: Mapping[str, Tool]) -> list[str]:
        return [f"</{name}>" for name in tools] + [f"</{self.answer_tag}>"]

    def parse(self, text: str, tools: Mapping[str, Tool]) -> ToolCall | ToolResult | None:
        """The turn's call, an invalid-call result, or None (an answer / no call: it ends)."""
        stripped = text.rstrip()
        if stripped.endswith(f"</{self.answer_tag}>"):
            return None
        for name, tool in tools.items():
            close = f"</{name}>"
            if close in text:
                pattern = rf"<{re.escape(name)}>(.*?){re.escape(close)}"
                matches = re.findall(pattern, text, re.S)
                body = matches[-1].strip() if matches else ""
                if not body:
                    return ToolResult(
                        f"Error: invalid call; write <{name}>...</{name}> with the "
                        f"{tool.main_argument or 'input'} inside, or give the final answer in "
                        f"<{self.answer_tag}>...</{self.answer_tag}>",
                        "invalid",
                    )
                return ToolCall(name, {tool.main_argument or "input": body})
        return None

    def observation(self, text: str) -> str:
        tag = self.observation_tag
        return f"\n\n<{tag}>{text.strip()}</{tag}>\n\n"


class JsonFormat:
    """Hermes/Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
    the answer in ``<answer>...</answer>``; observations as ``<tool_response>...``."""

    name = "json"

    def __init__(self, answer_tag: str = "answer"):
        self.answer_tag = answer_tag

    def stops(self, tools: Mapping[str, Tool]) -> list[str]:
        return ["</tool_call>", f"</{self.answer_tag}>"]

    def parse(self, text: str, tools: Mapping[str, Tool]) -> ToolCall | ToolResult | None:
        if text.rstrip().endswith(f"</{self.answer_tag}>") or "</tool_call>" not in text:
            return None
        matches = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)
        try:
            call = json.loads(matches[-1]) if matches else None
        except json.JSONDecodeError:
            call = None
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not isinstance(call.get("arguments", {}), dict)
        ):
            return ToolResult(
                'Error: invalid call; write <tool_call>{"name": ..., "arguments": {...}}'
                "</tool_call>",
                "invalid",
            )
        return ToolCall(call["name"], call.get("arguments", {}))

    def observation(self, text: str) -> str:
        return f"\n<tool_response>\n{text.strip()}\n</tool_response>\n"


FORMATS: dict[str, type[TagFormat | JsonFormat | ChatFormat]] = {
    "search_r1": TagFormat,
    "tags": TagFormat,
    "json": JsonFormat,
    "chat": ChatFormat,
}


# ---------------------------------------------------------------------------- sessions
class ReplaySession:
    """A session for engines without one of their own: each turn re-sends every asked row's
    whole context (prompt and response so far) as a prompt of ``engine.generate``.

    vLLM's prefix caching makes the re-sent prefix cost nothing to recompute. Each turn
    samples with a seed of its own derived from the call's, so a seeded rollout repeats; the
    rows still active in a turn are that call's prompts, so unlike `HFSession` a row's draws
    depend on which rows are still active.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        prompts: Batch,
        n: int,
        sampling: SamplingParams,
        prompt_offset: int = 0,
        rows: torch.Tensor | None = None,
    ) -> None:
        input_ids, mask = check_prompts(prompts, n)
        prompt_of = torch.arange(len(prompts)).repeat_interleave(n)
        rows = torch.arange(len(prompt_of)) if rows is None else rows
        self.contexts = [input_ids[p][mask[p]].tolist() for p in prompt_of[rows].tolist()]
        self.engine, self.sampling = engine, sampling
        self.offset = prompt_offset * n + int(rows[0]) if len(rows) else prompt_offset * n
        self.turn = 0
        self.eos = set(getattr(engine, "eos_ids", []))
        self.pad = int(getattr(engine, "pad_id", 0))
        self.tokenizer = getattr(engine, "tokenizer", None)

    def generate(
        self, rows: torch.Tensor, stop: Sequence[str], budget: torch.Tensor
    ) -> list[tuple[list[int], list[float], str]]:
        out: list[tuple[list[int], list[float], str]] = [([], [], "")] * len(self.contexts)
        asked = [r for r in rows.nonzero().flatten().tolist() if int(budget[r]) > 0]
        if not asked:
            return out
        width = max(len(self.contexts[r]) for r in asked)
        ids = torch.full((len(asked), width), self.pad, dtype=torch.long)
        mask = torch.zeros(len(asked), width, dtype=torch.bool)
        for i, r in enumerate(asked):
            ids[i, width - len(self.contexts[r]) :] = torch.tensor(self.contexts[r])
            mask[i, width - len(self.contexts[r]) :] = True
        seed = self.sampling.seed
        sampling = replace(
            self.sampling,
            stop=list(dict.fromkeys([*self.sampling.stop, *stop])),
            max_new_tokens=max(int(budget[r]) for r in asked),
            seed=None if seed is None else (seed * 1_000_003 + self.turn) % 2**62,
        )
        self.turn += 1
        result = self.engine.generate(
            Batch({"input_ids": ids, "attention_mask": mask}),
            1,
            sampling,
            prompt_offset=self.offset,
        )
        for i, r in enumerate(asked):
            m = result["response_mask"][i].bool()
            tokens = result["responses"][i][m].tolist()[: int(budget[r])]
            lps = result["rollout_log_probs"][i][m].tolist()[: len(tokens)]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer else ""
            if tokens and tokens[-1] in self.eos:
                reason = "eos"
            elif stop and any(s in text for s in stop):
                reason = "stop"
            else:
                reason = "length"
            out[r] = (tokens, lps, reason)
            self.contexts[r].extend(tokens)  # the row's context goes on from its turn
        return out

    def append(self, observations: Mapping[int, Sequence[int]]) -> None:
        for r, obs in observations.items():
            self.contexts[r].extend(int(t) for t in obs)

    def close(self) -> None:
        self.contexts = []


# ---------------------------------------------------------------------------- the loop
class AgentLoop(RolloutEngine):
    """Multi-turn tool-use rollouts over an engine (see the module docstring).

    Args:
        engine: the generation engine (``hf`` keeps its KV cache across turns).
        tools: name -> `Tool`.
        tokenizer: decodes turns and tokenizes observations.
        max_turns: most tool observations per sample (then one last turn without tools).
        format: ``search_r1`` (tags), ``json``, ``chat`` (the tokenizer's chat template,
            `lmrl.rollout.chat`: checked here by `check_template`), or a format object.
        state_masking: observations are False in ``response_mask`` (not trained).
        max_obs_length: most tokens of one observation (the head is kept); None = no limit.
        tool_timeout_s: wall-clock limit of one tool's calls in a turn.
        tool_workers: tools run at once.
        max_tool_error_fraction: a tool at fault on at least this fraction of its calls in the
            first rollout that calls it ``MIN_CHECKED_CALLS`` times raises `ToolRunError`;
            > 1 = never.
        pipeline_groups: the rows of each micro-batch split into this many groups, each its
            own session, whose tool calls run in the background while another group decodes
            (`lmrl.rollout.turns`); 1 = all rows decode together and wait for the turn's
            calls (``rollout.multi_turn.pipeline_groups``; docs/async.md has when more pays).

    Rows are reported to the hook of `set_row_done` the moment their last turns end (an
    answer, no call, the turn or token limit), whatever the engine it wraps.
    """

    reports_rows = True

    def __init__(
        self,
        engine: RolloutEngine,
        tools: Mapping[str, Tool],
        tokenizer,
        max_turns: int = 4,
        format: str | TagFormat | JsonFormat | ChatFormat = "search_r1",
        state_masking: bool = True,
        max_obs_length: int | None = None,
        tool_timeout_s: float = 30.0,
        tool_workers: int = 4,
        max_tool_error_fraction: float = 0.9,
        pipeline_groups: int = 1,
    ) -> None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 0:
            raise ValueError(f"max_turns must be an int >= 0, got {max_turns!r}")
        if (
            isinstance(pipeline_groups, bool)
            or not isinstance(pipeline_groups, int)
            or (pipeline_groups < 1)
        ):
            raise ValueError(f"pipeline_groups must be an int >= 1, got {pipeline_groups!r}")
        if max_obs_length is not None and max_obs_length < 1:
            raise ValueError(f"max_obs_length must be >= 1 or None, got {max_obs_length}")
        if isinstance(format, str):
            if format not in FORMATS:
                raise ValueError(f"unknown tool-call format {format!r}; known: {sorted(FORMATS)}")
            format = FORMATS[format]()
        self.engine, self.tools, self.tokenizer = engine, dict(tools), tokenizer
        self.max_turns, self.format = max_turns, format
        self.state_masking, self.max_obs_length = state_masking, max_obs_length
        self.tool_timeout_s, self.tool_workers = tool_timeout_s, tool_workers
        self.max_tool_error_fraction = float(max_tool_error_fraction)
        self.pipeline_groups = pipeline_groups
        self._in_flight = CallsInFlight(self.tools, tool_timeout_s, tool_workers, pipeline_groups)
        self._checked: set[str] = set()  # tools whose first batch was judged
        self._clip_said = False  # an observation cut by max_obs_length was logged
        self._rollouts = 0
        self.shares_weights = engine.shares_weights
        self.pad_id = engine.pad_id
        self._row_done: RowDone | None = None
        self._seeds = CallSeeds(None)  # for unseeded calls of an engine without its own
        self.eos_ids = getattr(engine, "eos_ids", [])
        if isinstance(format, ChatFormat):
            format.bind(tokenizer, self.tools, self.eos_ids)

    def note_clipping(self, text: str, tokens: int | None = None) -> None:
        """Log once per loop (a run's) that observations are being cut to ``max_obs_length``,
        when ``text`` (an observation as the tool returned it) is longer than that: more than
        ``OBS_CHARS_PER_TOKEN`` characters a token of it, or ``tokens`` (its token count, when
        it was tokenized whole; else counted here, only while nothing was logged yet).
        """
        most = self.max_obs_length
        if most is None or self._clip_said or 4 * len(text) <= most:
            return  # no limit, said already, or too short: at most 4 tokens (bytes) a character
        if len(text) > most * OBS_CHARS_PER_TOKEN:
            size = f"{len(text):,} characters"
        else:
            if tokens is None:
                tokens = len(self.tokenizer.encode(text, add_special_tokens=False))
            if tokens <= most:
                return
            size = f"{tokens:,} tokens"
        self._clip_said = True
        log.warning(
            "tool observations are being clipped: one of %s was cut to "
            "rollout.multi_turn.max_obs_length=%d tokens (its head kept; logged once); raise "
            "rollout.multi_turn.max_obs_length to keep more of them",
            size,
            most,
        )

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        self.engine.sync_weights(state_dict)

    def set_row_done(self, hook: RowDone | None) -> None:
        """Report rows as their last turns end (see `RolloutEngine.set_row_done`)."""
        self._row_done = hook

    def view(self) -> EngineView:
        """The wrapped engine's: the loop generates with its model."""
        return self.engine.view()

    def close(self) -> None:
        """Close the tools and the wrapped engine."""
        self._in_flight.close()
        for tool in self.tools.values():
            tool.close()
        self.engine.close()

    def _session(self, prompts: Batch, n: int, sampling: SamplingParams, offset: int, rows):
        opener = getattr(self.engine, "open_session", None)
        if callable(opener):
            return opener(prompts, n, sampling, prompt_offset=offset, rows=rows)
        return ReplaySession(self.engine, prompts, n, sampling, offset, rows=rows)

    def generate(
        self,
        prompts: Batch,
        n: int = 1,
        sampling: SamplingParams | None = None,
        *,
        prompt_offset: int = 0,
    ) -> Batch:
        sampling = sampling or SamplingParams()
        check_prompts(prompts, n)
        count = len(prompts) * n
        # the engine's micro-batch bounds the rows (and so the KV cache) of one session
        size = getattr(self.engine, "micro_batch_size", None) or count
        if sampling.seed is None:  # one seed for every chunk: a chunk's draws are its rows'
            seeds = getattr(self.engine, "seeds", None) or self._seeds
            sampling = replace(sampling, seed=seeds.for_call(sampling))
        rows: list[Row] = []
        usage: dict[str, list[ToolResult]] = {}
        stops = list(dict.fromkeys([*self.format.stops(self.tools), *sampling.stop]))
        for start in range(0, count, size):
            chunk = torch.arange(start, min(start + size, count))
            parts = [p for p in torch.tensor_split(chunk, self.pipeline_groups) if len(p)]
            groups: list[Group] = []
            try:
                for part in parts:
                    chats = None
                    if isinstance(self.format, ChatFormat):
                        chats = self.format.conversations(prompts, n, part)
                    session = self._session(prompts, n, sampling, prompt_offset, part)
                    group = Group(self, session, len(part), sampling.max_new_tokens, stops, chats)
                    group.on_done = self._reporter(prompts, n, part, group, sampling)
                    groups.append(group)
                run_groups(groups, self._run_calls, self._in_flight.submit)
            finally:
                for group in reversed(groups):  # a session restores the flags it found
                    group.session.close()
            for group in groups:  # the calls' results in the order of the rows' groups
                rows += group.rows
                for name, results in group.usage.items():
                    usage.setdefault(name, []).extend(results)
        self._rollouts += 1
        self._check_tools(usage)
        return self._assemble(prompts, n, rows, sampling.logprob_temperature)

    def _reporter(self, prompts: Batch, n: int, part: torch.Tensor, group: Group, sampling):
        """``group.on_done`` for the hook of `set_row_done`: the group's finished rows (its
        ``part`` of the call's rows) made into a block, or None without a hook."""
        hook = self._row_done
        if hook is None:
            return None

        def done(idx: list[int]) -> None:
            rows = part[idx]
            block = self._assemble(prompts.index(rows // n), 1, [group.rows[i] for i in idx],
                                   sampling.logprob_temperature)  # fmt: skip
            hook(rows, block)

        return done

    def _check_tools(self, usage: Mapping[str, Sequence[ToolResult]]) -> None:
        """Judge each tool once, in the first rollout that calls it ``MIN_CHECKED_CALLS``
        times (see the module docstring).

        Args:
            usage: tool name -> the results of its calls in this rollout.

        Raises:
            ToolRunError: a tool at fault on at least ``max_tool_error_fraction`` of them.
        """
        for name, results in usage.items():
            if name in self._checked or len(results) < MIN_CHECKED_CALLS:
                continue
            self._checked.add(name)
            failed = [r for r in results if r.fault]
            if not failed or len(failed) < self.max_tool_error_fraction * len(results):
                continue
            which = (
                "the first batch"
                if self._rollouts == 1
                else f"batch {self._rollouts} (the first with {MIN_CHECKED_CALLS}+ calls of it)"
            )
            first = failed[0].text.removeprefix("Error: ")
            raise ToolRunError(
                f"the {name} tool failed on {len(failed)} of {len(results)} calls of {which} "
                f"({len(failed) / len(results):.0%}); first {failed[0].status}: {first}"
            )

    def _run_calls(self, calls: Sequence[ToolCall | ToolResult]) -> list[ToolResult]:
        """A turn's calls, run in this thread and awaited."""
        return run_calls(calls, self.tools, self.tool_timeout_s, self.tool_workers)

    def _assemble(self, prompts: Batch, n: int, rows: list[Row], temperature: float) -> Batch:
        width = max(1, max(len(row.tokens) for row in rows))
        count = len(rows)
        responses = torch.full((count, width), int(self.pad_id), dtype=torch.long)
        real = torch.zeros(count, width, dtype=torch.bool)
        sampled = torch.zeros(count, width, dtype=torch.bool)
        log_probs = torch.zeros(count, width, dtype=torch.float32)
        for i, row in enumerate(rows):
            k = len(row.tokens)
            if k:
                responses[i, :k] = torch.tensor(row.tokens, dtype=torch.long)
                real[i, :k] = True
                sampled[i, :k] = torch.tensor(row.sampled)
                log_probs[i, :k] = torch.tensor(row.log_probs, dtype=torch.float32)
        response_mask = sampled if self.state_masking else real
        device = prompts["input_ids"].device
        out = finish_rollout(
            prompts,
            n,
            responses.to(device),
            response_mask.to(device),
            log_probs.to(device),
            temperature,
            response_attention=real.to(device),
        )
        stats = np.array(
            [
                [r.turns, r.calls, r.valid, r.errors, r.timeouts, r.obs_tokens, r.answered]
                for r in rows
            ],
            dtype=np.float32,
        )
        for j, key in enumerate(AGENT_KEYS):
            out[key] = torch.from_numpy(stats[:, j].copy()).to(device)
        return out
