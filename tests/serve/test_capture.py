"""The capture (`lmrl.serve.capture`): an agent's calls stitched into token-exact trajectories.

1,000 generated multi-turn conversations with tool calls (Qwen2.5, Qwen3 thinking, Llama 3.1,
Mistral v0.3; the generator of tests/rollout/test_chat_template.py) are played by a scripted
agent through the capture, in OpenAI's wire form, with a stub engine that samples what the
template renders for each assistant turn: the trained ids are the sampled ids and the
template's rendering of the whole conversation, with 0 mismatches. Edits of history, forks and
a template that re-renders earlier turns split the episode's trajectories and are counted.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("pydantic")  # the serve extra (with fastapi)

from tests.rollout.chat_templates import TEMPLATES, tokenizer_for
from tests.rollout.test_chat_template import TOOLS, assistant_spans, conversation

from lmrl.serve.capture import Capture, Choice, to_batch
from lmrl.serve.messages import Renderer, canonical, template_messages
from lmrl.serve.protocol import ChatCompletionRequest

CONVERSATIONS = 250  # per template: 1,000 in all
SCHEMAS = [tool.schema() for tool in TOOLS.values()]


def wire(message: dict) -> dict:
    """A template-form message as an OpenAI client sends it (arguments as JSON strings)."""
    import json

    out = {k: v for k, v in message.items() if k != "tool_calls"}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(c["function"]["arguments"]),
                },
            }
            for c in message["tool_calls"]
        ]
    return out


class Agent:
    """A scripted agent: sends its messages, appends the reply it gets and the tool results
    of the script; the stub engine samples the template's rendering of the script's next
    assistant turn."""

    def __init__(self, capture: Capture, episode: str, messages: list[dict], kwargs=None):
        self.capture, self.episode, self.kwargs = capture, episode, kwargs
        self.sent = [wire(m) for m in messages]
        self.version = 0

    def template(self, sent=None) -> list[dict]:
        request = ChatCompletionRequest(model="m", messages=sent or self.sent, tools=SCHEMAS)
        return template_messages(request)

    def call(self, target: dict | list[int], sent=None):
        """One call whose sampled turn is ``target`` (or the ids given); returns (prompt,
        sampled, reply)."""
        r = self.capture.renderer
        messages = self.template(sent)
        prompt = self.capture.chat_prompt(self.episode, messages, SCHEMAS, self.kwargs)
        if isinstance(target, list):
            sampled = target
        else:  # the stub engine: the template's own tokens of ``target`` after the prompt
            g = prompt.template_prompt
            s = r.render([*messages, target], SCHEMAS, False, self.kwargs)
            assert s[: len(g)] == g
            tail = s[len(g) :]
            sampled = tail[: next(i for i, t in enumerate(tail) if t in r.end_ids) + 1]
        reply = r.reply(sampled, [], tools=True)
        self.version += 1
        lps = [-0.01 * (k + 1) for k in range(len(sampled))]
        key = canonical([*messages, reply.message], SCHEMAS, self.kwargs)
        self.capture.record(self.episode, prompt, [Choice(sampled, lps)], self.version, [key])
        return prompt, sampled, reply


def play(agent: Agent, script: list[dict], start: int, turns=None) -> list[list[int]]:
    """Play ``script``'s turns from ``start`` (an assistant message); the sampled ids (each
    turn's ``turns``, when given: the template's tokens of the script's turns)."""
    sampled_all = []
    j = start
    while j < len(script):
        _, sampled, reply = agent.call(turns[len(sampled_all)] if turns else script[j])
        sampled_all.append(sampled)
        agent.sent.append(reply.wire())
        k = j + 1
        calls = reply.message.get("tool_calls") or []
        while k < len(script) and script[k]["role"] == "tool":
            k += 1
        assert len(calls) == k - j - 1, "the reply's calls are the script's"
        for call, result in zip(calls, script[j + 1 : k], strict=True):
            agent.sent.append({"role": "tool", "tool_call_id": call["id"],
                               "content": result["content"]})  # fmt: skip
        j = k
    return sampled_all


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_an_agents_calls_stitch_into_the_templates_conversation(name):
    """250 conversations per template (1,000 in all) through the capture: one trajectory
    each, its ids the template's rendering of the conversation the agent ends with, its
    trained ids the sampled ids, its mask on the assistant turns alone: 0 mismatches."""
    tok = tokenizer_for(name)
    capture = Capture(Renderer(tok))
    rng = random.Random(f"serve-{name}")
    mismatches, turns = [], 0
    for k in range(CONVERSATIONS):
        script = conversation(rng, name)
        last = max(i for i, m in enumerate(script) if m["role"] == "user")
        agent = Agent(capture, f"e{k}", script[: last + 1])
        # the stub engine samples each assistant turn as the template renders the script
        rendered = capture.renderer.render(script, SCHEMAS, False)
        spans = assistant_spans(name, tok, rendered)
        runs = [i for i in range(1, len(rendered)) if spans[i] and not spans[i - 1]]
        runs = runs[len(runs) - sum(m["role"] == "assistant" for m in script[last:]) :]
        turns_ids = []
        for i in runs:
            end = i
            while end < len(rendered) and spans[end]:
                end += 1
            turns_ids.append(rendered[i:end])
        sampled = play(agent, script, last + 1, turns_ids)
        trajectories = capture.trajectories(f"e{k}")
        if len(trajectories) != 1 or any(capture.splits(f"e{k}").values()):
            mismatches.append((k, "split", capture.splits(f"e{k}")))
            continue
        t = trajectories[0]
        ids = t.prompt + t.responses
        whole = capture.renderer.render(agent.template(), SCHEMAS, False)
        reference = assistant_spans(name, tok, whole)
        trained = [x for x, m in zip(t.responses, t.response_mask, strict=True) if m]
        if whole[: len(ids)] != ids or any(reference[len(ids) :]):
            mismatches.append((k, "ids"))
        elif t.response_mask != reference[len(t.prompt) : len(ids)]:
            mismatches.append((k, "mask"))
        elif trained != [x for s in sampled for x in s]:
            mismatches.append((k, "trained ids"))
        elif t.versions != list(range(1, len(sampled) + 1)):
            mismatches.append((k, "versions"))
        turns += len(sampled)
    assert not mismatches, f"{len(mismatches)} of {CONVERSATIONS}: first {mismatches[0]}"
    assert turns > 2 * CONVERSATIONS


def qwen_agent(capture=None):
    capture = capture or Capture(Renderer(tokenizer_for("qwen2.5")))
    script = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Find Paris."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "c1",
         "function": {"name": "search", "arguments": {"query": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "France"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "c2",
         "function": {"name": "search", "arguments": {"query": "Lyon"}}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "also France"},
        {"role": "assistant", "content": "France."},
    ]  # fmt: skip
    agent = Agent(capture, "ep", script[:2])
    play(agent, script, 2)
    return capture, agent


def test_a_call_that_edits_history_starts_a_counted_trajectory():
    capture, agent = qwen_agent()
    assert len(capture.trajectories("ep")) == 1
    edited = [dict(m) for m in agent.sent]
    edited[1]["content"] = "Find Lyon."  # a rewritten earlier message
    agent.call({"role": "assistant", "content": "Lyon."}, sent=edited)
    reordered = [agent.sent[1], agent.sent[0], *agent.sent[2:]]
    agent.call({"role": "assistant", "content": "Hm."}, sent=reordered)
    assert capture.splits("ep") == {"edit": 2, "fork": 0, "template": 0}
    trajectories = capture.trajectories("ep")
    assert len(trajectories) == 3
    # the new trajectories hold only their own call: the prompt is the template's rendering
    fresh = trajectories[1]
    r = capture.renderer
    assert fresh.prompt == r.render(agent.template(edited), SCHEMAS, True)
    assert all(fresh.response_mask) and fresh.calls == [3]


def test_a_call_from_an_earlier_point_of_history_is_a_fork():
    capture, agent = qwen_agent()
    back = agent.sent[:4]  # the first reply and its result, again
    prompt, _, _ = agent.call({"role": "assistant", "content": "Done."}, sent=back)
    dropped = [m for i, m in enumerate(agent.sent) if i != 3]  # a tool result dropped
    agent.call({"role": "assistant", "content": "Hm."}, sent=dropped)
    assert capture.splits("ep") == {"edit": 0, "fork": 2, "template": 0}
    calls = capture.calls("ep")
    # its prompt is still built from the sampled ids, not re-tokenized
    first = calls[0]
    assert prompt.ids[: len(first.prompt) + len(first.choices[0].ids)] == (
        first.prompt + first.choices[0].ids
    )
    assert [t.calls for t in capture.trajectories("ep")] == [[0, 1, 2], [3], [4]]


def test_qwen3_dropping_earlier_thinking_is_a_template_split():
    capture = Capture(Renderer(tokenizer_for("qwen3")))
    script = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye.", "reasoning_content": "Part."},
    ]
    agent = Agent(capture, "ep", script[:1])
    play(agent, script[:2], 1)
    agent.sent.append({"role": "user", "content": "Bye"})
    agent.call(script[3])
    assert capture.splits("ep") == {"edit": 0, "fork": 0, "template": 1}


def test_trajectories_make_a_training_batch():
    capture, agent = qwen_agent()
    agent.call({"role": "assistant", "content": "Lyon."}, sent=agent.sent[:4])  # a fork
    trajectories = capture.trajectories("ep")
    batch = to_batch(trajectories, pad_id=0)
    b, p = batch["prompts"].shape
    t = batch["responses"].shape[1]
    assert (b, batch["input_ids"].shape[1]) == (2, p + t)
    for i, tr in enumerate(trajectories):
        n = len(tr.responses)
        assert batch["responses"][i, :n].tolist() == tr.responses
        assert batch["response_mask"][i, :n].tolist() == tr.response_mask
        assert not batch["response_mask"][i, n:].any()
        assert batch["prompts"][i, p - len(tr.prompt) :].tolist() == tr.prompt
    # log-probs on the sampled ids only; the glue between calls is masked and 0
    assert torch.equal(batch["rollout_log_probs"] != 0, batch["response_mask"])
    assert batch["weights_version"].tolist() == [1, 4]
    assert list(batch["uid"]) == ["ep", "ep"]
    masked = batch["responses"][0][~batch["response_mask"][0]][:8].tolist()
    assert capture.renderer.decode(masked).startswith("\n<|im_start|>user")
