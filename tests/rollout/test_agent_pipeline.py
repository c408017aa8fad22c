"""Tool calls in flight (`lmrl.rollout.turns`): groups of rows whose calls run while another
group decodes give the rollout the tools' timing cannot change, and one group is the loop as
it was."""

from __future__ import annotations

import random
import threading
import time
from typing import ClassVar

import pytest
import torch

from lmrl.batch import Batch
from lmrl.errors import ToolRunError
from lmrl.models.tiny import build_tokenizer
from lmrl.rollout import HFEngine, RolloutEngine, SamplingParams
from lmrl.rollout.agent import MIN_CHECKED_CALLS, AgentLoop, TagFormat, clip_text
from lmrl.tools import Tool, ToolCall, ToolFault, run_calls

PAD, EOS = 256, 258
KEYS = ("responses", "response_mask", "attention_mask", "rollout_log_probs", "agent_turns",
        "agent_tool_calls", "agent_valid_calls", "agent_tool_errors", "agent_tool_timeouts",
        "agent_obs_tokens", "agent_answered")  # fmt: skip


class Echo(Tool):
    """``found <query>``, after ``delay()`` seconds (0 = at once)."""

    name = "search"
    parameters: ClassVar[dict] = {"type": "object", "properties": {"query": {"type": "string"}}}

    def __init__(self, delay=lambda: 0.0):
        self.delay = delay

    def __call__(self, arguments):
        if seconds := self.delay():
            time.sleep(seconds)
        return f"found {arguments['query']}"


class EveryE(TagFormat):
    """Every turn ends at an ``e`` and calls the search tool with the turn's last 3 chars."""

    def stops(self, tools):
        return ["e"]

    def parse(self, text, tools):
        return ToolCall("search", {"query": text[-3:]})


def same(a: Batch, b: Batch) -> bool:
    return all(torch.equal(a[k], b[k]) for k in KEYS)


# ---------------------------------------------------------------------------- hf engine
@pytest.fixture(scope="module")
def biased(tiny_dir):
    from lmrl.models import load_causal_lm

    model = load_causal_lm(tiny_dir).eval()
    bias = torch.zeros(model.config.vocab_size)
    bias[ord("e")] = 4.5  # a turn ends every few tokens
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    return model


def rollout(model, tokenizer, encode, groups, tool, seed=0):
    loop = AgentLoop(HFEngine(model, tokenizer), {"search": tool}, tokenizer, max_turns=2,
                     format=EveryE(), max_obs_length=6, pipeline_groups=groups)  # fmt: skip
    try:
        return loop.generate(
            encode(["hello there", "a"]), 2, SamplingParams(max_new_tokens=30, seed=seed)
        )
    finally:
        loop.close()


def test_random_tool_delays_change_nothing_and_groups_sample_what_one_batch_does(
    biased, tokenizer, encode
):
    """The samples are keyed by row and token, not by timing or by the rows decoded beside."""
    rng = random.Random(0)
    instant = rollout(biased, tokenizer, encode, 2, Echo())
    assert instant["agent_tool_calls"].sum() >= 5  # rows really went through turns
    jittery = rollout(biased, tokenizer, encode, 2, Echo(lambda: rng.choice([0, 0.002, 0.03])))
    assert same(jittery, instant)
    # the draws are the rows' own, so one batch samples the same tokens; its log-probs may
    # differ in the last bits (a batch of another shape), as with rollout.micro_batch_size
    whole = rollout(biased, tokenizer, encode, 1, Echo())
    assert all(torch.equal(whole[k], instant[k]) for k in KEYS if k != "rollout_log_probs")
    assert torch.allclose(whole["rollout_log_probs"], instant["rollout_log_probs"], atol=1e-5)


# ---------------------------------------------------------------------------- scripted
class Session:
    """Row r (of the whole batch) samples ``script[r][k]`` at its k-th turn; every
    ``generate`` and ``append`` is recorded in ``events``."""

    def __init__(self, engine, rows):
        self.engine, self.rows = engine, rows.tolist()
        self.turn = [0] * len(self.rows)

    def generate(self, asked, stop, budget):
        with self.engine.changed:
            self.engine.events.append(("generate", tuple(self.rows)))
            self.engine.changed.notify_all()
        out = [([], [], "")] * len(self.rows)
        for i in asked.nonzero().flatten().tolist():
            text = self.engine.script[self.rows[i]][self.turn[i]]
            self.turn[i] += 1
            ids = self.engine.tok.encode(text, add_special_tokens=False)[: int(budget[i])]
            out[i] = (ids, [-(j + 1) / 100 for j in range(len(ids))], "stop")
        return out

    def append(self, observations):
        self.engine.events.append(("append", tuple(self.rows[i] for i in observations)))

    def close(self):
        self.engine.events.append(("close", tuple(self.rows)))


class Scripted(RolloutEngine):
    pad_id, eos_ids = PAD, [EOS]

    def __init__(self, script, tok):
        self.script, self.tok, self.events = script, tok, []
        self.changed = threading.Condition()  # notified by every generate

    def open_session(self, prompts, n, sampling, prompt_offset=0, rows=None):
        return Session(self, rows)

    def generate(self, prompts, n=1, sampling=None, *, prompt_offset=0):
        raise AssertionError("the agent loop must use the session")

    def sync_weights(self, state_dict=None):
        pass


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def prompts(tok, count):
    enc = tok(["q"] * count, return_tensors="pt", padding=True)
    return Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"].bool()})


def calling(rows):
    """Row r searches ``r`` twice, then answers."""
    return [[f"<search>{r}</search>", f"<search>{r}</search>", "<answer>x</answer>"]
            for r in range(rows)]  # fmt: skip


class WaitsForADecode(Tool):
    """Answers once another session has begun to decode since the calling rows' session
    last did (or after ``patience`` seconds), recording which it was."""

    name = "search"
    parameters: ClassVar[dict] = {"type": "object", "properties": {"query": {"type": "string"}}}

    def __init__(self, engine, patience):
        self.engine, self.patience, self.overlapped = engine, patience, []

    def call_batch(self, calls):
        row = int(calls[0]["query"])
        events = self.engine.events

        def other_decoded():
            mine = max(i for i, (kind, rows) in enumerate(events) if row in rows)
            return any(kind == "generate" for kind, _ in events[mine + 1 :])

        with self.engine.changed:
            self.overlapped.append(self.engine.changed.wait_for(other_decoded, self.patience))
        return [f"found {c['query']}" for c in calls]


def test_a_group_decodes_while_another_groups_calls_are_in_flight(tok):
    engine = Scripted(calling(4), tok)
    tool = WaitsForADecode(engine, patience=5.0)
    loop = AgentLoop(engine, {"search": tool}, tok, max_turns=2, pipeline_groups=2)
    out = loop.generate(prompts(tok, 4), 1, SamplingParams(max_new_tokens=300))
    loop.close()
    # every turn's calls (2 groups x 2 turns) answered only after the other group decoded
    assert tool.overlapped == [True] * 4
    assert out["agent_tool_calls"].tolist() == [2] * 4
    gen = [rows for kind, rows in engine.events if kind == "generate"]
    assert gen[:2] == [(0, 1), (2, 3)]  # group 2 decoded before group 1's calls came back
    assert not [t for t in threading.enumerate() if t.name.startswith("lmrl-tools")]


def test_one_group_runs_each_turn_as_the_loop_always_did(tok):
    """Decode, then every call of the turn awaited, then the observations: in that order."""
    engine = Scripted(calling(3), tok)
    tool = WaitsForADecode(engine, patience=0.01)
    loop = AgentLoop(engine, {"search": tool}, tok, max_turns=2)  # pipeline_groups=1
    assert loop.pipeline_groups == 1
    out = loop.generate(prompts(tok, 3), 1, SamplingParams(max_new_tokens=300))
    assert tool.overlapped == [False, False]  # nothing decoded while a call ran
    rows = (0, 1, 2)
    assert engine.events == [("generate", rows), ("append", rows)] * 2 + [
        ("generate", rows), ("close", rows)]  # fmt: skip
    assert not [t for t in threading.enumerate() if t.name.startswith("lmrl-tools")]
    want = reference(tok, calling(3), {"search": Echo()}, max_turns=2)
    assert all(torch.equal(out[k], v) for k, v in want.items())


def reference(tok, script, tools, max_turns):
    """The agent loop before groups (its ``_run``, kept here as written then), on the
    scripted engine: the one-group rollout must equal it bit for bit."""
    loop = AgentLoop(Scripted(script, tok), tools, tok, max_turns=max_turns)
    count, budget = len(script), 300
    session = loop.engine.open_session(None, 1, None, rows=torch.arange(count))
    rows = [{"tokens": [], "sampled": [], "lps": [], "n": [0] * 7, "done": False}
            for _ in range(count)]  # fmt: skip
    stops = loop.format.stops(loop.tools)
    for turn in range(max_turns + 1):
        active = [i for i, row in enumerate(rows) if not row["done"]]
        if not active:
            break
        asked = torch.zeros(count, dtype=torch.bool)
        asked[active] = True
        left = torch.tensor([budget - len(row["tokens"]) for row in rows])
        outs = session.generate(asked, stops, left)
        calls, callers = [], []
        for i in active:
            row, (tokens, lps, reason) = rows[i], outs[i]
            row["tokens"] += tokens
            row["sampled"] += [True] * len(tokens)
            row["lps"] += lps
            row["n"][0] += 1
            text = tok.decode(tokens, skip_special_tokens=True)
            answered = text.rstrip().endswith("</answer>")
            if reason != "stop" or len(row["tokens"]) >= budget:
                row["done"], row["n"][6] = True, reason == "stop" and answered
                continue
            call = loop.format.parse(text, loop.tools)
            if call is None or turn == max_turns:
                row["done"], row["n"][6] = True, call is None and answered
                continue
            calls.append(call)
            callers.append(i)
        if not calls:
            continue
        results = run_calls(calls, loop.tools, loop.tool_timeout_s, loop.tool_workers)
        observations = {}
        for i, result in zip(callers, results, strict=True):
            row = rows[i]
            row["n"][1] += 1
            row["n"][2] += result.status in ("ok", "error", "timeout")
            row["n"][3] += result.status == "error"
            row["n"][4] += result.status == "timeout"
            room = budget - len(row["tokens"])
            text = clip_text(loop.format.observation(result.text), room)
            ids = tok.encode(text, add_special_tokens=False)[:room]
            row["tokens"] += ids
            row["sampled"] += [False] * len(ids)
            row["lps"] += [0.0] * len(ids)
            row["n"][5] += len(ids)
            observations[i] = ids
        session.append(observations)
    width = max(len(row["tokens"]) for row in rows)
    out = {"responses": torch.full((count, width), PAD),
           "response_mask": torch.zeros(count, width, dtype=torch.bool),
           "rollout_log_probs": torch.zeros(count, width)}  # fmt: skip
    for i, row in enumerate(rows):
        k = len(row["tokens"])
        out["responses"][i, :k] = torch.tensor(row["tokens"])
        out["response_mask"][i, :k] = torch.tensor(row["sampled"])
        out["rollout_log_probs"][i, :k] = torch.tensor(row["lps"])
    keys = ("agent_turns", "agent_tool_calls", "agent_valid_calls", "agent_tool_errors",
            "agent_tool_timeouts", "agent_obs_tokens", "agent_answered")  # fmt: skip
    for j, key in enumerate(keys):
        out[key] = torch.tensor([float(row["n"][j]) for row in rows])
    return out


# ---------------------------------------------------------------------------- failures
class Faulty(Tool):
    """Fails every call with a `ToolFault` naming its query, after a random short delay."""

    name = "search"
    parameters: ClassVar[dict] = {"type": "object", "properties": {"query": {"type": "string"}}}

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def __call__(self, arguments):
        time.sleep(self.rng.choice([0.0, 0.02]))
        raise ToolFault(f"server down for {arguments['query']}")


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_failures_in_flight_are_results_and_judged_as_before(tok, groups):
    rows = MIN_CHECKED_CALLS + 1
    once = [[f"<search>q{r}</search>", "<answer>x</answer>"] for r in range(rows)]
    loop = AgentLoop(Scripted(once, tok), {"search": Faulty(groups)}, tok, max_turns=1,
                     pipeline_groups=groups)  # fmt: skip
    # the first error quoted is row 0's, whichever group's calls failed first
    with pytest.raises(ToolRunError, match=rf"failed on {rows} of {rows} calls of the first "
                       r"batch \(100%\); first error: server down for q0$"):  # fmt: skip
        loop.generate(prompts(tok, rows), 1, SamplingParams(max_new_tokens=300))
    loop.close()

    class Slow(Echo):
        def __call__(self, arguments):
            time.sleep(0.2 if arguments["query"] in ("q0", "q3") else 0.0)
            return super().__call__(arguments)

    loop = AgentLoop(Scripted(once[:4], tok), {"search": Slow()}, tok, max_turns=1,
                     tool_timeout_s=0.1, pipeline_groups=groups)  # fmt: skip
    out = loop.generate(prompts(tok, 4), 1, SamplingParams(max_new_tokens=300))
    loop.close()
    # a tool's calls of one turn share its timeout: a group of a slow call times out whole
    timed_out = {1: [1, 1, 1, 1], 2: [1, 1, 1, 1], 3: [1, 1, 0, 1]}[groups]
    assert out["agent_tool_timeouts"].tolist() == timed_out
    assert out["agent_tool_errors"].tolist() == [0] * 4
    text = tok.decode(out["responses"][0])
    assert "Error: the search tool timed out after 0.1 s" in text
