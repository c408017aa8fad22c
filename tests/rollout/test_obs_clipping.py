"""Observations cut to ``max_obs_length`` are said once (on the tools' logger ``lmrl.tools``),
with the observation's size, the limit and the key to raise."""

from __future__ import annotations

import logging

import pytest
import torch

from lmrl.batch import Batch
from lmrl.models.tiny import build_tokenizer
from lmrl.rollout import SamplingParams
from lmrl.rollout.agent import AgentLoop, TagFormat
from lmrl.tools import function_tool

from .chat_templates import QWEN25
from .test_agent import ScriptedEngine, prompts_of

KEY = "rollout.multi_turn.max_obs_length"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def search_returning(text: str):
    def search(query: str) -> str:
        """Search.

        Args:
            query: what
        """
        return text

    return {"search": function_tool(search, "search")}


def clipping_records(caplog):
    return [r for r in caplog.records if r.name == "lmrl.tools" and "clipped" in r.message]


def run(loop, tok, rows: int = 2):
    prompts = prompts_of(tok, ["q"] * rows)
    return loop.generate(prompts, 1, SamplingParams(max_new_tokens=300))


def test_a_huge_observation_is_said_once_with_its_size_and_the_key(tok, caplog):
    huge = "passage " * 625_000  # 5 MB a hit
    script = [["<search>q</search>", "<answer>x</answer>"]] * 2
    loop = AgentLoop(ScriptedEngine(script, tok), search_returning(huge), tok, max_turns=1,
                     max_obs_length=50)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lmrl.tools"):
        out = run(loop, tok)
        loop.engine.script = script  # a second rollout of the same loop: said already
        run(loop, tok)
    assert out["agent_obs_tokens"].tolist() == [50.0, 50.0]  # the cut itself is unchanged
    [record] = clipping_records(caplog)
    size = len(TagFormat().observation(huge))
    assert f"one of {size:,} characters" in record.message
    assert f"{KEY}=50 tokens" in record.message and f"raise {KEY}" in record.message


def test_an_observation_over_the_limit_in_tokens_is_said_with_its_token_count(tok, caplog):
    text = "abcdefghij" * 10  # 100 byte tokens, 100 characters: cut by tokens, not characters
    script = [["<search>q</search>", "<answer>x</answer>"]]
    loop = AgentLoop(ScriptedEngine(script, tok), search_returning(text), tok, max_turns=1,
                     max_obs_length=60)  # fmt: skip
    whole = len(tok.encode(TagFormat().observation(text), add_special_tokens=False))
    with caplog.at_level(logging.WARNING, logger="lmrl.tools"):
        run(loop, tok, rows=1)
    [record] = clipping_records(caplog)
    assert f"one of {whole:,} tokens" in record.message and f"{KEY}=60 tokens" in record.message


@pytest.mark.parametrize("limit", [None, 200])
def test_observations_within_the_limit_say_nothing(tok, caplog, limit):
    script = [["<search>q</search>", "<answer>x</answer>"]]
    loop = AgentLoop(ScriptedEngine(script, tok), search_returning("short " * 20), tok,
                     max_turns=1, max_obs_length=limit)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lmrl.tools"):
        run(loop, tok, rows=1)
    assert clipping_records(caplog) == []


def test_the_chat_format_says_it_too(caplog):
    tok = build_tokenizer()
    tok.chat_template = QWEN25
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "abcdef"}}\n</tool_call>'
    engine = ScriptedEngine([[call + "<|im_end|>", "done<|im_end|>"]], tok)
    loop = AgentLoop(engine, search_returning("x" * 10_000), tok, format="chat",
                     max_obs_length=3)  # fmt: skip
    raw = [[{"role": "user", "content": "q"}]]
    ids = torch.tensor([loop.format.render(raw[0], True)])
    batch = Batch({"input_ids": ids, "attention_mask": ids >= 0}, {"raw_prompt": raw})
    with caplog.at_level(logging.WARNING, logger="lmrl.tools"):
        loop.generate(batch, 1, SamplingParams(max_new_tokens=300))
    [record] = clipping_records(caplog)
    assert "one of 10,000 characters" in record.message and f"{KEY}=3 tokens" in record.message
