"""Template-exact multi-turn (`lmrl.rollout.chat`): the agent loop's tokens and masks equal
the chat template's rendering of the whole conversation, for Qwen2.5, Qwen3 (thinking),
Llama 3.1 and Mistral v0.3 (`chat_templates`), over generated conversations; the start-up
check names the first differing token and the rule of a template that breaks it."""

from __future__ import annotations

import logging
import random
import string

import pytest
import torch

from lmrl.batch import Batch
from lmrl.errors import DataError, ModelError
from lmrl.models.tiny import build_tokenizer
from lmrl.rollout import HFEngine, SamplingParams
from lmrl.rollout.agent import AgentLoop
from lmrl.rollout.chat import (
    ChatFormat,
    TemplateMismatch,
    check_template,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    probe,
    replay,
)
from lmrl.tools import function_tool

from .chat_templates import QWEN3, QWEN25, TEMPLATES, tokenizer_for

CONVERSATIONS = 250  # per template: 1,000 in all


def search(query: str) -> str:
    """Search the corpus.

    Args:
        query: what to look for
    """
    return f"found {query}"


def calculator(expression: str, precision: int = 2) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression
        precision: digits after the point
    """
    return "42"


TOOLS = {"search": function_tool(search, "search"), "calculator": function_tool(calculator)}


# ---------------------------------------------------------------------------- conversations
WORDS = ["the", "answer", "is", "Paris", "42", "x=1;", "def f():", "  indented", "ok.", "?"]
UNICODE = ["é", "中文", "🙂", "naïve", "Ωmega", "e\u0301", "\u00a0", "ß"]
SPECIAL = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_end|>", "<|eot_id|>",
           "</s>", "[INST]", "[TOOL_CALLS]", "<|endoftext|>", '{"name": "x"}', "<tool_response>",
           "```json", "\\n", '"quoted"', "{", "}"]  # fmt: skip
# what the model cannot write inside an assistant message: an end-of-turn token, or the
# template's own call and thinking markup
NOT_IN_ASSISTANT = {"<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_end|>",
                    "<|eot_id|>", "</s>", "[TOOL_CALLS]", "<|endoftext|>", '{"name": "x"}',
                    "<tool_response>", "{"}  # fmt: skip


def text(rng: random.Random, assistant: bool = False, empty_ok: bool = True) -> str:
    """Random content: words, newlines, unicode and special-looking text."""
    specials = [s for s in SPECIAL if not (assistant and s in NOT_IN_ASSISTANT)]
    parts = []
    for _ in range(rng.randint(0 if empty_ok else 1, 8)):
        kind = rng.random()
        pool = WORDS if kind < 0.55 else UNICODE if kind < 0.7 else specials
        parts.append(rng.choice(pool) if kind < 0.85 else "\n" * rng.randint(1, 3))
    out = " ".join(parts) if rng.random() < 0.7 else "".join(parts)
    return out if out.strip() or empty_ok else "fine"


def arguments(rng: random.Random) -> dict:
    values = [lambda: rng.randint(-5, 999), lambda: text(rng, assistant=True),
              lambda: rng.random() < 0.5,
              lambda: [rng.randint(0, 9) for _ in range(rng.randint(0, 3))]]  # fmt: skip
    return {rng.choice(["query", "expression", "n", "ids", "flag", "q"]) + str(k): rng.choice(values)()
            for k in range(rng.randint(0, 3))}  # fmt: skip


def call_id(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(9))


def assistant(rng, name: str, calls: int, thinking: bool) -> dict:
    """An assistant message with ``calls`` tool calls (0 = an answer) in ``name``'s style;
    Qwen3's with a reasoning when ``thinking`` (after the last user message, always)."""
    content = text(rng, assistant=True, empty_ok=calls > 0)
    if name == "qwen3" and not content.strip("\n"):
        content = ""  # Qwen3 renders newline-only content as none, but not its calls' "\n"
    if name in ("llama3.1", "mistral") and calls:
        content = ""  # these templates render no content beside calls
    if name == "llama3.1" and not calls:
        content = content.strip() or "fine"
    message = {"role": "assistant", "content": content}
    if name == "qwen3" and thinking:
        message["reasoning_content"] = text(rng, assistant=True, empty_ok=False)
    if calls:
        message["tool_calls"] = [
            {"type": "function", "id": call_id(rng),
             "function": {"name": rng.choice(list(TOOLS)), "arguments": arguments(rng)}}
            for _ in range(calls)
        ]  # fmt: skip
    return message


def tool_messages(rng, message: dict) -> list[dict]:
    return [
        {"role": "tool", "name": c["function"]["name"], "tool_call_id": c["id"],
         "content": text(rng)}
        for c in message["tool_calls"]
    ]  # fmt: skip


def exchange(rng, name: str, agent: bool) -> list[dict]:
    """Tool-call turns with their results, then an answer (``agent``: after the last user
    message, where Qwen3 thinks in every turn)."""
    most = 1 if name == "llama3.1" else 3
    out = []
    for _ in range(rng.randint(0, 3)):
        message = assistant(rng, name, rng.randint(1, most), agent or rng.random() < 0.5)
        out += [message, *tool_messages(rng, message)]
    return [*out, assistant(rng, name, 0, agent or rng.random() < 0.5)]


def conversation(rng: random.Random, name: str) -> list[dict]:
    """System (not for Mistral, whose template moves it: see the test below), a history of
    earlier exchanges, the last user message, and the agent's turns after it."""
    messages = []
    if name != "mistral" and rng.random() < 0.6:
        messages.append({"role": "system", "content": text(rng, empty_ok=False)})
    for _ in range(rng.randint(0, 2)):
        messages += [{"role": "user", "content": text(rng, empty_ok=False)}]
        messages += exchange(rng, name, agent=False)
    messages.append({"role": "user", "content": text(rng, empty_ok=False)})
    return messages + exchange(rng, name, agent=True)


# ---------------------------------------------------------------------------- reference spans
def assistant_spans(name: str, tok, ids: list[int]) -> list[bool]:
    """True on the tokens of each assistant message from its header to its end-of-turn token,
    found from the template's own markup (independent of `lmrl.rollout.chat`)."""
    out = [False] * len(ids)
    if name == "mistral":
        starts = {tok.convert_tokens_to_ids(t) for t in ("[/INST]", "[/TOOL_RESULTS]")}
        results, end = tok.convert_tokens_to_ids("[TOOL_RESULTS]"), tok.eos_token_id
        heads = [i + 1 for i, t in enumerate(ids[:-1]) if t in starts and ids[i + 1] != results]
    else:
        header = "<|im_start|>assistant\n" if name.startswith("qwen") else (
            "<|start_header_id|>assistant<|end_header_id|>\n\n")  # fmt: skip
        h = tok.encode(header, add_special_tokens=False)
        end = tok.eos_token_id
        heads = [i + len(h) for i in range(len(ids)) if ids[i : i + len(h)] == h]
    for i in heads:
        j = i
        while j < len(ids) and ids[j] != end:
            out[j] = True
            j += 1
        if j < len(ids):
            out[j] = True
    return out


@pytest.fixture(scope="module")
def formats():
    return {name: ChatFormat(tokenizer=tokenizer_for(name), tools=TOOLS) for name in TEMPLATES}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_agent_loop_builds_the_whole_conversations_tokens_and_masks(formats, name):
    """250 generated conversations per template (1,000 in all), rebuilt turn by turn as the
    agent loop builds them: 0 mismatches in ids and in which tokens the model wrote."""
    fmt, rng = formats[name], random.Random(f"chat-{name}")
    checked = turns = calls = 0
    mismatches = []
    for k in range(CONVERSATIONS):
        messages = conversation(rng, name)
        whole = fmt.render(messages, False)
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        prompt = len(fmt.render(messages[: last + 1], True))
        try:
            ids, sampled = replay(fmt, messages)
        except TemplateMismatch as err:
            mismatches.append((k, str(err)))
            continue
        reference = assistant_spans(name, fmt.tokenizer, whole)
        if whole[: len(ids)] != ids or any(reference[len(ids) :]):
            mismatches.append((k, "ids"))
        elif sampled[prompt:] != reference[prompt : len(ids)]:
            mismatches.append((k, "mask"))
        checked += 1
        turns += sum(m["role"] == "assistant" for m in messages[last:])
        calls += sum(m["role"] == "tool" for m in messages[last:])
    assert not mismatches, f"{len(mismatches)} of {CONVERSATIONS}: first {mismatches[0]}"
    assert checked == CONVERSATIONS and turns > 2 * CONVERSATIONS and calls > CONVERSATIONS


def test_the_four_templates_pass_the_start_up_check(formats, caplog):
    for name in ("qwen2.5", "qwen3", "llama3.1"):
        check_template(formats[name])
    with caplog.at_level(logging.WARNING):
        check_template(formats["mistral"])  # passes without its system message
    assert "system message" in caplog.text
    with pytest.raises(ModelError, match=r"token \d+ differs.*system message only while"):
        replay(formats["mistral"], probe(formats["mistral"]))


def test_qwen3_without_thinking_is_checked_with_an_empty_think_block():
    fmt = ChatFormat(tokenizer=tokenizer_for("qwen3"), tools=TOOLS)
    fmt.template_kwargs = {"enable_thinking": False}
    with pytest.raises(ModelError, match=r"without their <think> block \(here the empty one"):
        check_template(fmt)  # Qwen3 renders the empty block only on the last message


BROKEN = QWEN3.replace("loop.last or (not loop.last and reasoning_content)", "loop.last")


def test_a_template_that_drops_earlier_thinking_fails_the_check_naming_the_token():
    tok = tokenizer_for("qwen3")
    tok.chat_template = BROKEN
    fmt = ChatFormat(tokenizer=tok, tools=TOOLS)
    with pytest.raises(ModelError) as info:
        check_template(fmt)
    message = str(info.value)
    assert "\n" not in message
    err = info.value
    assert isinstance(err, TemplateMismatch)
    ids, _ = replay(ChatFormat(tokenizer=tokenizer_for("qwen3"), tools=TOOLS), probe(fmt))
    assert err.ours == ids[err.position]  # the agent loop's token there
    assert tok.decode([err.ours]) == "<think>"
    assert f"token {err.position} differs: the agent loop has '<think>'" in message
    assert "re-renders earlier assistant turns without their <think> block" in message
    with pytest.raises(ModelError, match="without their <think> block"):
        AgentLoop(_Null(), TOOLS, tok, format="chat")  # the start-up check runs


def test_a_newline_the_template_adds_after_the_end_of_turn_token_is_an_observation(formats):
    """Qwen's ``<|im_end|>\\n``: the model writes <|im_end|>, the template adds the newline."""
    fmt = formats["qwen2.5"]
    ids, sampled = replay(fmt, probe(fmt))
    end = fmt.tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = sampled.index(True)
    k = ids.index(end, first)
    assert sampled[k] and not sampled[k + 1] and fmt.decode(ids[k + 1 : k + 2]) == "\n"


def test_llama_results_go_in_an_ipython_turn_and_mistral_in_tool_results(formats):
    ids, sampled = replay(formats["llama3.1"], probe(formats["llama3.1"]))
    added = formats["llama3.1"].decode([t for t, s in zip(ids, sampled, strict=True) if not s])
    assert added.endswith(
        '<|start_header_id|>ipython<|end_header_id|>\n\n"84"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids, sampled = replay(formats["mistral"], probe(formats["mistral"], system=False))
    added = formats["mistral"].decode([t for t, s in zip(ids, sampled, strict=True) if not s])
    assert added.endswith(
        '[/INST][TOOL_RESULTS] {"content": 84, "call_id": "call00001"}[/TOOL_RESULTS]'
    )


def test_the_parsers_read_each_syntax():
    call = '{"name": "search", "arguments": {"query": "a\\nb"}}'
    assert parse_hermes(f"hi\n<tool_call>\n{call}\n</tool_call>") == (
        "hi", [{"type": "function", "function": {"name": "search", "arguments": {"query": "a\nb"}}}])  # fmt: skip
    assert parse_hermes("<tool_call>\n{bad\n</tool_call>")[1] is None
    assert parse_hermes("just an answer") == ("just an answer", [])
    assert parse_llama3_json('{"name": "f", "parameters": {"x": 1}}')[1][0]["function"] == {
        "name": "f", "arguments": {"x": 1}}  # fmt: skip
    assert parse_llama3_json("The answer is 4.") == ("The answer is 4.", [])
    content, calls = parse_mistral(
        '[TOOL_CALLS] [{"name": "f", "arguments": {}, "id": "abcdefghi"}]'
    )
    assert calls[0]["id"] == "abcdefghi" and content == ""
    assert parse_mistral("[TOOL_CALLS] [oops")[1] is None


def test_prompts_without_messages_are_refused_in_one_line(formats):
    fmt = formats["qwen2.5"]
    batch = Batch({"input_ids": torch.ones(1, 3, dtype=torch.long),
                   "attention_mask": torch.ones(1, 3, dtype=torch.bool)})  # fmt: skip
    with pytest.raises(DataError, match="raw_prompt"):
        fmt.conversations(batch, 1, torch.arange(1))


class _Null:
    eos_ids, pad_id, shares_weights = [258], 256, True

    def sync_weights(self, state_dict=None):
        pass


# ---------------------------------------------------------------------------- end to end
SCRIPT = {
    "Where is A?": [
        '<tool_call>\n{"name": "search", "arguments": {"query": "A"}}\n</tool_call>',
        "A is found.",
    ],
    "Where are B and C?": [
        '<tool_call>\n{"name": "search", "arguments": {"query": "B"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "search", "arguments": {"query": "C"}}\n</tool_call>',
        'One more.\n<tool_call>\n{"name": "search", "arguments": {"query": "D"}}\n</tool_call>',
        "B, C and D are found.",
    ],
}  # both first turns start with "<": the prefill's rows need no script


def cache_of(kwargs):
    """The key/value cache a forward was given (``cache`` from transformers 5.2x)."""
    return kwargs["cache"] if "cache" in kwargs else kwargs["past_key_values"]


def script(model, tok, prompts: list[list[int]]):
    """Hooks making ``model`` write row r's ``SCRIPT`` turns (each then ``<|im_end|>``): they
    read each row's tokens by position and put the logits on the script's next token."""
    pad, end = 256, 258
    gen = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    targets = [[[*tok.encode(turn, add_special_tokens=False), end] for turn in turns]
               for turns in SCRIPT.values()]  # fmt: skip
    fed: dict[int, dict[int, int]] = {b: {} for b in range(len(prompts))}

    def before(module, args, kwargs):
        ids, pos = kwargs["input_ids"], kwargs["position_ids"]
        if cache_of(kwargs).get_seq_length() == 0:
            return  # the prefill (its rows deduplicated and reordered)
        for b in range(ids.shape[0]):
            for t, p in zip(ids[b].tolist(), pos[b].tolist(), strict=True):
                if t != pad and p >= len(prompts[b]):
                    fed[b][p] = t

    def after(module, args, kwargs, out):
        out.logits[:, -1] = -30.0
        if cache_of(kwargs).get_seq_length() == kwargs["input_ids"].shape[1]:
            out.logits[:, -1, ord("<")] = 30.0
            return out
        for b in range(out.logits.shape[0]):
            seq = [fed[b][p] for p in sorted(fed[b])]  # since the prompt (its gen prompt)
            starts = [0] + [i + len(gen) for i in range(len(seq)) if seq[i : i + len(gen)] == gen]
            target = targets[b][len(starts) - 1]
            out.logits[b, -1, target[min(len(seq) - starts[-1], len(target) - 1)]] = 30.0
        return out

    return [model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True)]  # fmt: skip


def test_an_hf_rollout_in_chat_format_is_the_templates_conversation(model):
    tok = build_tokenizer()
    tok.chat_template = QWEN25
    tools = {"search": TOOLS["search"]}
    fmt = ChatFormat(tokenizer=tok, tools=tools)
    raw = [[{"role": "user", "content": q}] for q in SCRIPT]
    prompts = [fmt.render(m, True) for m in raw]
    width = max(map(len, prompts))
    ids = torch.tensor([[256] * (width - len(p)) + p for p in prompts])
    batch = Batch({"input_ids": ids, "attention_mask": ids != 256}, {"raw_prompt": raw})
    loop = AgentLoop(HFEngine(model, tok), tools, tok, max_turns=3, format="chat")
    hooks = script(model, tok, prompts)
    try:
        out = loop.generate(batch, 1, SamplingParams(max_new_tokens=600, do_sample=False))
    finally:
        for hook in hooks:
            hook.remove()
    assert out["agent_answered"].tolist() == [1.0, 1.0]
    assert out["agent_tool_calls"].tolist() == [1.0, 3.0]
    assert out["agent_turns"].tolist() == [2.0, 3.0]
    T = out["responses"].shape[1]
    for r, (question, turns) in enumerate(SCRIPT.items()):
        messages = [{"role": "user", "content": question}]
        for turn in turns:
            content, calls = parse_hermes(turn)
            messages.append({"role": "assistant", "content": content})
            if calls:
                messages[-1]["tool_calls"] = calls
            messages += [{"role": "tool", "content": search(**c["function"]["arguments"])}
                         for c in calls]  # fmt: skip
        whole = fmt.render(messages, False)
        real = out["attention_mask"][r, -T:]
        got = prompts[r] + out["responses"][r][real].tolist()
        assert got == whole[: len(got)] and tok.decode(whole[len(got) :]) == "\n"
        mask = out["response_mask"][r][real].tolist()
        assert mask == assistant_spans("qwen2.5", tok, whole)[len(prompts[r]) : len(got)]
        observed = real & ~out["response_mask"][r]
        assert observed.any() and (out["rollout_log_probs"][r][observed] == 0).all()


def test_max_obs_length_cuts_each_result_inside_the_templates_tool_message():
    """A scripted session (no model): the result's text is cut to 3 tokens before it is
    rendered, so the template's markup around it stays whole; without state masking every
    real token trains."""
    from .test_agent import ScriptedEngine

    tok = build_tokenizer()
    tok.chat_template = QWEN25
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "abcdef"}}\n</tool_call>'
    engine = ScriptedEngine([[call + "<|im_end|>", "done<|im_end|>"]], tok)
    tools = {"search": TOOLS["search"]}
    loop = AgentLoop(engine, tools, tok, format="chat", max_obs_length=3, state_masking=False)
    raw = [[{"role": "user", "content": "q"}]]
    ids = torch.tensor([loop.format.render(raw[0], True)])
    batch = Batch({"input_ids": ids, "attention_mask": ids >= 0}, {"raw_prompt": raw})
    out = loop.generate(batch, 1, SamplingParams(max_new_tokens=300))
    text = tok.decode(out["responses"][0][out["response_mask"][0]])
    assert "<|im_start|>user\n<tool_response>\nfou\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\ndone<|im_end|>")
    assert out["agent_answered"].tolist() == [1.0]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_datasets_prompts_are_what_the_agent_loop_renders_with_its_tools(name, tmp_path):
    """A chat run's prompts are rendered with the tools (``lmrl.trainer.build`` passes
    `tool_schemas` to the dataset): the agent loop's rendering of the same messages with its
    tools gives the same ids, so the conversation starts template-exact."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmrl.data.dataset import RLDataset
    from lmrl.tools.loading import tool_schemas

    user = tmp_path / "tools.py"
    user.write_text(
        "def search(query: str) -> str:\n"
        '    """Search the corpus.\n\n    Args:\n        query: what to look for\n    """\n'
        "    return query\n"
    )
    messages = [{"role": "user", "content": "Who wrote Lumo?"}]
    rows = [{"prompt": messages, "data_source": "x", "reward_model": {"ground_truth": "y"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    tok = tokenizer_for(name)
    schemas = tool_schemas(["search"], user)
    data = RLDataset(tmp_path / "train.parquet", tok, max_prompt_length=8192,
                     chat_template_kwargs={"tools": schemas})  # fmt: skip
    fmt = ChatFormat(tokenizer=tok, tools={"search": function_tool(search, "search")})
    assert data[0]["input_ids"] == fmt.render(messages, generation=True)
    assert "Search the corpus" in tok.decode(data[0]["input_ids"])
