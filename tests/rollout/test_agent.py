"""Tests of the multi-turn agent loop: the token layout, state masking, and the hf session."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

from lmrl.batch import Batch, last_true, response_tokens_mask
from lmrl.config import ActorConfig, OptimConfig
from lmrl.errors import ToolRunError
from lmrl.models import compute_log_probs
from lmrl.models.tiny import build_tokenizer
from lmrl.rollout import HFEngine, RolloutEngine, SamplingParams
from lmrl.rollout.agent import (
    MIN_CHECKED_CALLS,
    OBS_CHARS_PER_TOKEN,
    AgentLoop,
    JsonFormat,
    TagFormat,
)
from lmrl.rollout.merge import concat_rollouts
from lmrl.tools import Tool, ToolCall, ToolError, ToolFault, ToolTimeout, function_tool
from lmrl.workers.actor import ActorWorker

PAD, EOS = 256, 258


def echo(query: str) -> str:
    """Echo a query.

    Args:
        query: what to echo
    """
    return f"found {query}"


TOOLS = {"search": function_tool(echo, "search")}


# ---------------------------------------------------------------------------- scripted
class ScriptedSession:
    """Row r's k-th turn samples ``script[r][k]`` (text), log-prob -(position+1)/100 each."""

    def __init__(self, script, tok):
        self.script, self.tok = script, tok
        self.turn = [0] * len(script)
        self.appended: list[dict[int, list[int]]] = []
        self.closed = False

    def generate(self, rows, stop, budget):
        out = [([], [], "")] * len(self.script)
        for r in rows.nonzero().flatten().tolist():
            text = self.script[r][self.turn[r]]
            self.turn[r] += 1
            ids = self.tok.encode(text, add_special_tokens=False)
            reason = "eos" if ids and ids[-1] == EOS else "stop"
            if len(ids) > budget[r]:
                ids, reason = ids[: int(budget[r])], "length"
            out[r] = (ids, [-(i + 1) / 100 for i in range(len(ids))], reason)
        return out

    def append(self, observations):
        self.appended.append({r: list(v) for r, v in observations.items()})

    def close(self):
        self.closed = True


class ScriptedEngine(RolloutEngine):
    pad_id, eos_ids = PAD, [EOS]

    def __init__(self, script, tok):
        self.script, self.tok, self.sessions = script, tok, []

    def open_session(self, prompts, n, sampling, prompt_offset=0, rows=None):
        self.sessions.append(ScriptedSession(self.script, self.tok))
        return self.sessions[-1]

    def generate(self, prompts, n=1, sampling=None, *, prompt_offset=0):
        raise AssertionError("the agent loop must use the session")

    def sync_weights(self, state_dict=None):
        pass


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def prompts_of(tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True)
    return Batch(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"].bool()},
        {"data_source": ["s"] * len(texts)},
    )


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_three_turn_layout_masks_log_probs_and_counters(tok):
    fmt = TagFormat()
    script = [
        ["<search>ab</search>", "<search>cd</search>", "<answer>x</answer>"],
        ["<answer>y</answer>"],
    ]
    engine = ScriptedEngine(script, tok)
    loop = AgentLoop(engine, TOOLS, tok, max_turns=2)
    out = loop.generate(prompts_of(tok, ["q1", "q2"]), 1, SamplingParams(max_new_tokens=200))
    assert engine.sessions[0].closed
    pieces = [
        ("<search>ab</search>", True),
        (fmt.observation("found ab"), False),
        ("<search>cd</search>", True),
        (fmt.observation("found cd"), False),
        ("<answer>x</answer>", True),
    ]
    want = [t for text, _ in pieces for t in ids(tok, text)]
    sampled = [s for text, s in pieces for _ in ids(tok, text)]
    T = out["responses"].shape[1]
    assert len(want) == T
    assert out["responses"][0].tolist() == want
    assert out["response_mask"][0].tolist() == sampled  # state masking: observations False
    assert response_tokens_mask(out)[0].all()  # but read: attention True on them
    lp = out["rollout_log_probs"][0]
    assert (lp[~out["response_mask"][0]] == 0).all() and (lp[out["response_mask"][0]] < 0).all()
    # the second row answered at once: no observation, right-padded
    n1 = len(ids(tok, "<answer>y</answer>"))
    assert out["response_mask"][1].tolist() == [True] * n1 + [False] * (T - n1)
    assert (out["responses"][1, n1:] == PAD).all()
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    pos = out["position_ids"][0, -T:]
    assert torch.equal(pos, pos[0] + torch.arange(T))  # contiguous through the observations
    assert out["agent_turns"].tolist() == [3, 1]
    assert out["agent_tool_calls"].tolist() == [2, 0]
    assert out["agent_valid_calls"].tolist() == [2, 0]
    assert out["agent_answered"].tolist() == [1, 1]
    assert out["agent_obs_tokens"][0] == len(want) - sum(sampled)
    # observations were fed once per turn (row 0 only), the pending token is the session's
    appended = engine.sessions[0].appended
    assert [list(a) for a in appended] == [[0], [0]]
    assert last_true(out["response_mask"]).tolist() == [T - 1, n1 - 1]


def test_max_turns_stops_calls_and_max_obs_length_cuts_observations(tok):
    script = [["<search>ab</search>", "<search>cd</search>", "<answer>x</answer>"]]
    loop = AgentLoop(ScriptedEngine(script, tok), TOOLS, tok, max_turns=1, max_obs_length=5)
    out = loop.generate(prompts_of(tok, ["q"]), 1, SamplingParams(max_new_tokens=200))
    first = ids(tok, "<search>ab</search>")
    obs = ids(tok, TagFormat().observation("found ab"))[:5]
    second = ids(tok, "<search>cd</search>")
    assert out["responses"][0].tolist() == first + obs + second  # the 2nd call is not run
    assert out["agent_turns"].tolist() == [2] and out["agent_tool_calls"].tolist() == [1]
    assert out["agent_answered"].tolist() == [0]


def test_the_budget_counts_observations_and_ends_a_row_without_room(tok):
    script = [["<search>ab</search>", "<answer>x</answer>"]]
    first = ids(tok, "<search>ab</search>")
    budget = len(first) + 7
    loop = AgentLoop(ScriptedEngine(script, tok), TOOLS, tok, max_turns=3)
    out = loop.generate(prompts_of(tok, ["q"]), 1, SamplingParams(max_new_tokens=budget))
    assert out["responses"].shape[1] == budget
    assert out["response_mask"][0].sum() == len(first)
    assert out["agent_obs_tokens"].tolist() == [7] and out["agent_turns"].tolist() == [1]


def test_without_state_masking_observations_count_as_generated(tok):
    script = [["<search>ab</search>", "<answer>x</answer>"]]
    loop = AgentLoop(ScriptedEngine(script, tok), TOOLS, tok, max_turns=2, state_masking=False)
    out = loop.generate(prompts_of(tok, ["q"]), 1, SamplingParams(max_new_tokens=200))
    assert torch.equal(out["response_mask"], response_tokens_mask(out))
    observations = out["rollout_log_probs"][0] == 0  # the scripted samples are all < 0
    assert observations.sum() == out["agent_obs_tokens"][0] > 0


def test_invalid_calls_and_unknown_tools_get_error_observations(tok):
    fmt = TagFormat()
    script = [["<search> </search>", "<answer>x</answer>"]]
    loop = AgentLoop(ScriptedEngine(script, tok), TOOLS, tok, max_turns=2)
    out = loop.generate(prompts_of(tok, ["q"]), 1, SamplingParams(max_new_tokens=300))
    text = tok.decode(out["responses"][0][response_tokens_mask(out)[0]])
    assert "Error: invalid call; write <search>...</search>" in text
    assert out["agent_tool_calls"].tolist() == [1] and out["agent_valid_calls"].tolist() == [0]
    js = JsonFormat()
    assert js.parse(
        '<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>', TOOLS
    ) == ToolCall("search", {"query": "a"})
    assert js.parse("<tool_call>{oops</tool_call>", TOOLS).status == "invalid"
    assert js.parse("<answer>3</answer>", TOOLS) is None
    assert fmt.parse("no call at all", TOOLS) is None


def test_concat_keeps_observations_in_the_attention(tok):
    script = [["<search>ab</search>", "<answer>x</answer>"]]
    loop = AgentLoop(ScriptedEngine(script, tok), TOOLS, tok, max_turns=2)
    a = loop.generate(prompts_of(tok, ["q"]), 1, SamplingParams(max_new_tokens=200))
    b = loop.generate(prompts_of(tok, ["a longer prompt"]), 1, SamplingParams(max_new_tokens=5))
    both = concat_rollouts([a, b], PAD)
    T = both["responses"].shape[1]
    assert torch.equal(response_tokens_mask(both)[0], response_tokens_mask(a)[0])
    assert both["response_mask"][0].sum() < response_tokens_mask(both)[0].sum()
    assert torch.equal(both["position_ids"][0, -T:], both["position_ids"][0, -T] + torch.arange(T))


# ---------------------------------------------------------------------------- hf engine
class EveryE(TagFormat):
    """Every turn ends at an ``e`` and calls the echo tool with the turn's text."""

    def stops(self, tools):
        return ["e"]

    def parse(self, text, tools):
        return ToolCall("search", {"query": text[-3:]})


@pytest.fixture
def e_biased(model, logit_bias):
    bias = torch.zeros(model.config.vocab_size)
    bias[ord("e")] = 3.5  # a turn ends about every 10 tokens
    with logit_bias(model, bias):
        yield model


def agent_batch(model, tok, encode, *, state_masking=True, seed=1, n=3, engine=None):
    engine = engine or HFEngine(model, tok)
    loop = AgentLoop(engine, TOOLS, tok, max_turns=3, format=EveryE(), max_obs_length=6,
                     state_masking=state_masking)  # fmt: skip
    return loop.generate(
        encode(["hello there", "a"]), n, SamplingParams(max_new_tokens=60, seed=seed)
    )


def test_hf_session_log_probs_match_the_trainers_forward(e_biased, tokenizer, encode):
    """The KV cache kept across turns (interior gaps, lazily fed tokens) gives the log-probs
    a fresh forward of the compact cat(prompt, responses) gives."""
    out = agent_batch(e_biased, tokenizer, encode)
    assert out["agent_tool_calls"].sum() >= 3  # several rows really went through turns
    lp, _ = compute_log_probs(e_biased, out, 64, temperature=1.0)
    mask = out["response_mask"]
    assert (lp[mask] - out["rollout_log_probs"][mask]).abs().max() < 1e-4


def test_hf_session_and_replay_sample_the_same_greedy_rollout(e_biased, tokenizer, encode):
    engine = HFEngine(e_biased, tokenizer)
    loop = AgentLoop(engine, TOOLS, tokenizer, max_turns=2, format=EveryE(), max_obs_length=6)
    greedy = SamplingParams(max_new_tokens=40, do_sample=False)
    cached = loop.generate(encode(["hello there", "a"]), 1, greedy)
    engine.open_session = None  # force the replay path (what vLLM uses)
    replayed = loop.generate(encode(["hello there", "a"]), 1, greedy)
    assert torch.equal(cached["responses"], replayed["responses"])
    assert torch.equal(cached["response_mask"], replayed["response_mask"])
    assert torch.allclose(cached["rollout_log_probs"], replayed["rollout_log_probs"], atol=1e-4)


def test_a_seed_repeats_a_multi_turn_rollout(e_biased, tokenizer, encode):
    a = agent_batch(e_biased, tokenizer, encode, seed=5)
    b = agent_batch(e_biased, tokenizer, encode, seed=5)
    assert torch.equal(a["responses"], b["responses"])


# ---------------------------------------------------------------------------- state masking
def _update(model, batch, n):
    """One actor update on a copy of ``model``; its new weights."""
    import copy

    model = copy.deepcopy(model)
    cfg = dataclasses.replace(
        ActorConfig(ppo_mini_batch_size=len(batch) // n, optim=OptimConfig(lr=1e-2,
                    weight_decay=0.0)), use_kl_loss=True, kl_loss_coef=0.5, ppo_epochs=1,
    )  # fmt: skip
    actor = ActorWorker(
        model, cfg, rollout_n=n, max_response_length=batch["responses"].shape[1],
        temperature=1.0, log_prob_micro_batch_size=None, total_steps=1,
    )  # fmt: skip
    actor.update_actor(batch)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("state_masking", [True, False])
def test_observation_tokens_do_not_train_under_state_masking(
    e_biased, tokenizer, encode, state_masking
):
    out = agent_batch(e_biased, tokenizer, encode, state_masking=state_masking, n=2)
    mask = out["response_mask"]
    obs = response_tokens_mask(out) & (out["rollout_log_probs"] == 0)  # observation tokens
    assert obs.any()
    g = torch.Generator().manual_seed(0)
    base = out.select(*out.keys())
    base["advantages"] = torch.where(mask, torch.randn(mask.shape, generator=g), 0.0)
    lp, _ = compute_log_probs(e_biased, out, 64)
    base["old_log_probs"] = torch.where(mask, lp + 0.1, 0.0)
    base["ref_log_probs"] = torch.where(mask, lp - 0.2, 0.0)
    moved = base.select(*base.keys())
    noise = torch.randn(mask.shape, generator=g)
    for key in ("old_log_probs", "ref_log_probs", "advantages"):
        moved[key] = torch.where(obs, base[key] + 3 * noise, base[key])
    same = all(
        torch.equal(a, b)
        for a, b in zip(_update(e_biased, base, 2), _update(e_biased, moved, 2), strict=True)
    )
    assert same is state_masking


def test_micro_batched_sessions_sample_what_one_session_samples(e_biased, tokenizer, encode):
    whole = agent_batch(e_biased, tokenizer, encode, seed=7)
    chunked = agent_batch(
        e_biased,
        tokenizer,
        encode,
        seed=7,
        engine=HFEngine(e_biased, tokenizer, micro_batch_size=4),
    )
    assert torch.equal(whole["responses"], chunked["responses"])
    assert torch.equal(whole["agent_tool_calls"], chunked["agent_tool_calls"])


# ---------------------------------------------------------------------------- failing tools
class Failing(Tool):
    """A search tool that fails every call with ``error`` (an exception instance)."""

    name = "search"
    parameters: ClassVar[dict] = {"type": "object", "properties": {"query": {"type": "string"}}}

    def __init__(self, error: Exception):
        self.error = error

    def __call__(self, arguments):
        raise self.error


def calling(rows: int) -> list[list[str]]:
    """The script of ``rows`` rows that each call search once, then answer."""
    return [["<search>q</search>", "<answer>x</answer>"] for _ in range(rows)]


def run_rows(tok, tools, rows, **options):
    loop = AgentLoop(ScriptedEngine(calling(rows), tok), tools, tok, max_turns=1, **options)
    return loop, loop.generate(prompts_of(tok, ["q"] * rows), 1, SamplingParams(max_new_tokens=300))


def test_a_tool_failing_nearly_every_call_of_the_first_batch_stops_the_run(tok):
    tools = {"search": Failing(ToolFault("retrieval server http://x answered HTTP 500"))}
    with pytest.raises(ToolRunError) as caught:
        run_rows(tok, tools, MIN_CHECKED_CALLS)
    text = str(caught.value)
    assert text.startswith(
        f"the search tool failed on {MIN_CHECKED_CALLS} of {MIN_CHECKED_CALLS} calls of the "
        "first batch (100%); first error: retrieval server http://x answered HTTP 500"
    )
    assert "\n" not in text
    # a bug in a tool (an exception that is no ToolError) and timeouts count the same
    with pytest.raises(ToolRunError, match=r"first error: KeyError: 'k'"):
        run_rows(tok, {"search": Failing(KeyError("k"))}, MIN_CHECKED_CALLS)
    with pytest.raises(ToolRunError, match="first timeout: slow"):
        run_rows(tok, {"search": Failing(ToolTimeout("slow"))}, MIN_CHECKED_CALLS)


def test_the_calls_own_errors_a_few_calls_or_a_healthy_tool_do_not_stop_it(tok):
    # the policy's bad calls (a plain ToolError) are its own fault
    _, out = run_rows(tok, {"search": Failing(ToolError("no such page"))}, 8)
    assert out["agent_tool_errors"].sum() == 8 and out["agent_tool_calls"].sum() == 8
    # too few calls to judge: the first rollout with enough is judged, once
    loop, out = run_rows(tok, {"search": Failing(ToolFault("down"))}, MIN_CHECKED_CALLS - 1)
    assert out["agent_tool_errors"].sum() == MIN_CHECKED_CALLS - 1
    loop.engine.script = calling(MIN_CHECKED_CALLS)
    prompts = prompts_of(tok, ["q"] * MIN_CHECKED_CALLS)
    with pytest.raises(ToolRunError, match=r"calls of batch 2 \(the first with 5\+ calls of it\)"):
        loop.generate(prompts, 1, SamplingParams(max_new_tokens=300))
    loop.generate(prompts, 1, SamplingParams(max_new_tokens=300))  # judged once only
    # 1 of 10 failing is a working tool; a threshold above 1 never stops
    run_rows(tok, {"search": FlakyTool(fail_every=10)}, 10)
    run_rows(tok, {"search": Failing(ToolFault("down"))}, 8, max_tool_error_fraction=1.01)


class FlakyTool(Tool):
    name = "search"
    parameters: ClassVar[dict] = {"type": "object", "properties": {"query": {"type": "string"}}}

    def __init__(self, fail_every: int):
        self.fail_every, self.calls = fail_every, 0

    def __call__(self, arguments):
        self.calls += 1
        if self.calls % self.fail_every == 0:
            raise ToolFault("hiccup")
        return "found"


def test_timeouts_are_counted_per_row(tok):
    tools = {"search": Failing(ToolTimeout("retrieval server http://x did not answer"))}
    _, out = run_rows(tok, tools, 3)
    assert out["agent_tool_timeouts"].tolist() == [1, 1, 1]
    assert out["agent_tool_errors"].tolist() == [0, 0, 0]


class CountingTokenizer:
    """The test tokenizer, recording how many characters each ``encode`` is handed."""

    def __init__(self, tok):
        self.tok, self.encoded = tok, []

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self.tok.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("max_obs_length", [50, None])
def test_a_huge_observation_is_cut_before_it_is_tokenized(tok, max_obs_length):
    huge = "passage " * 625_000  # 5 MB

    def search(query: str) -> str:
        """Search.

        Args:
            query: what
        """
        return huge

    tool = function_tool(search, "search")
    counting = CountingTokenizer(tok)
    budget = 300
    script = [["<search>q</search>", "<answer>x</answer>"]]
    loop = AgentLoop(ScriptedEngine(script, tok), {"search": tool}, counting, max_turns=1,
                     max_obs_length=max_obs_length)  # fmt: skip
    out = loop.generate(prompts_of(tok, ["q"]), 1, SamplingParams(max_new_tokens=budget))
    room = max_obs_length or budget - len(ids(tok, "<search>q</search>"))
    assert max(counting.encoded) <= room * OBS_CHARS_PER_TOKEN
    assert out["agent_obs_tokens"].tolist() == [room]  # still the exact token cut


def test_an_observation_with_a_lone_surrogate_is_tokenized_with_a_mark(tok):
    """A server's JSON may hold ``"\\ud800"``: the tokenizer cannot take it, the row goes on."""

    def search(query: str) -> str:
        """Search.

        Args:
            query: what
        """
        return "Doc 1(Title: T) caf\ud800 au lait"

    script = [["<search>q</search>", "<answer>x</answer>"]]
    loop = AgentLoop(ScriptedEngine(script, tok), {"search": function_tool(search)}, tok,
                     max_turns=1)  # fmt: skip
    out = loop.generate(prompts_of(tok, ["q"]), 1, SamplingParams(max_new_tokens=300))
    text = tok.decode(out["responses"][0][out["attention_mask"][0, -out["responses"].shape[1] :]])
    assert "caf? au lait" in text and out["agent_tool_errors"].tolist() == [0]
    assert out["agent_answered"].tolist() == [1]
