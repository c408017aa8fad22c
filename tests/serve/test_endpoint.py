"""The OpenAI-compatible endpoint driven by the official ``openai`` client: the tiny model
for plain chat, ``n``, ``stop``, ``max_tokens``, log-probs, streaming, completions and the
batching of concurrent requests; a scripted engine under Qwen2.5's template for tool calls
and the capture of whole agent conversations through HTTP; malformed and hostile requests
answered in OpenAI's error shape, the endpoint unharmed."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.serve.conftest import client_for  # noqa: E402

HELLO = [{"role": "user", "content": "Say hi."}]


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ---------------------------------------------------------------------------- the tiny model
def test_plain_chat_is_answered_and_captured_token_exact(tiny_server):
    client, episode = client_for(tiny_server)
    out = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8,
                                         logprobs=True, seed=3)  # fmt: skip
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.model == "tiny"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 8
    (call,) = tiny_server.endpoint.capture.calls(episode.id)
    r = tiny_server.endpoint.renderer
    assert call.prompt == r.render(HELLO, None, True)  # the template's prompt
    assert out.usage.prompt_tokens == len(call.prompt)
    sampled = call.choices[0]
    assert len(sampled.ids) == out.usage.completion_tokens
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(sampled.log_probs)
    assert all(lp <= 0 for lp in sampled.log_probs)
    assert models_listed(client) == ["tiny"]


def models_listed(client) -> list[str]:
    return [m.id for m in client.models.list().data]


def test_n_max_tokens_and_a_later_turn_that_extends_the_first(tiny_server):
    client, episode = client_for(tiny_server)
    out = client.chat.completions.create(model="tiny", messages=HELLO, n=3, max_tokens=5,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 15
    # the agent keeps choice 1 and goes on: the next prompt extends it, nothing re-tokenized
    messages = [*HELLO, {"role": "assistant", "content": out.choices[1].message.content},
                {"role": "user", "content": "Again."}]  # fmt: skip
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    capture = tiny_server.endpoint.capture
    first, second = capture.calls(episode.id)
    assert second.parent == (0, 1) and capture.splits(episode.id)["edit"] == 0
    kept = first.choices[1].ids
    assert second.prompt[: len(first.prompt) + 5] == first.prompt + kept
    trajectories = capture.trajectories(episode.id)
    assert [t.calls for t in trajectories] == [[0], [0], [0, 1]]
    longest = trajectories[2]
    trained = [x for x, m in zip(longest.responses, longest.response_mask, strict=True) if m]
    assert trained == kept + second.choices[0].ids


def test_stop_strings_cut_the_text(tiny_server):
    client, _ = client_for(tiny_server)
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=30, seed=5,
                  extra_body={"ignore_eos": True})  # fmt: skip
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = next((ch for ch in text[2:] if ch.isascii() and ch.isprintable()), None)
    assert stop is not None, f"no printable character in {text!r}"
    out = client.chat.completions.create(**kwargs, stop=[stop]).choices[0]
    assert out.message.content == text[: text.index(stop)]
    assert out.finish_reason == "stop"


def test_streaming_sends_the_same_completions_as_events(tiny_server):
    client, _ = client_for(tiny_server)
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=6, n=2, seed=11, logprobs=True)
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    texts, reasons, usage, logprobs = {0: "", 1: ""}, {}, None, {0: [], 1: []}
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.logprobs is not None:
                logprobs[c.index] += [t.logprob for t in c.logprobs.content]
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    for c in whole.choices:
        assert texts[c.index] == c.message.content
        assert reasons[c.index] == c.finish_reason
        assert logprobs[c.index] == pytest.approx([t.logprob for t in c.logprobs.content])
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_text_and_token_prompts(tiny_server):
    client, episode = client_for(tiny_server)
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=4, logprobs=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "length" and len(choice.logprobs.token_logprobs) == 4
    (call,) = tiny_server.endpoint.capture.calls(episode.id)
    assert call.prompt == [97, 98, 99]
    # a prompt of ids that extends the first call's prompt and completion continues it
    ids = call.prompt + call.choices[0].ids + [10]
    client.completions.create(model="tiny", prompt=ids, max_tokens=2)
    assert tiny_server.endpoint.capture.calls(episode.id)[1].parent == (0, 0)
    streamed = list(client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                              stream=True))  # fmt: skip
    assert streamed and streamed[0].object == "text_completion"


def test_concurrent_requests_share_engine_calls(tiny_server):
    endpoint = tiny_server.endpoint
    client, _ = client_for(tiny_server)
    answers = []

    def ask():
        answers.append(client.chat.completions.create(model="tiny", messages=HELLO,
                                                      max_tokens=3))  # fmt: skip

    before = endpoint.batcher.calls
    threads = [threading.Thread(target=ask) for _ in range(8)]
    with endpoint.batcher.hold():  # the engine takes nothing until all 8 wait
        for t in threads:
            t.start()
        wait_for(lambda: endpoint.batcher.pending == 8, "8 queued requests")
    for t in threads:
        t.join(120)
    assert len(answers) == 8
    assert endpoint.batcher.calls - before == 1  # one engine call for 8 requests


def test_the_weights_version_stamps_each_call(tiny_server):
    endpoint = tiny_server.endpoint
    client, episode = client_for(tiny_server)
    with endpoint.batcher.hold():
        endpoint.set_version(7)
    out = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
    assert out.system_fingerprint == "weights-v7"
    assert endpoint.capture.calls(episode.id)[0].version == 7
    endpoint.set_version(0)


# ---------------------------------------------------------------------------- hostile requests
def post(running, path, body, key=None, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(running.base_url + path, content=raw, headers=headers, timeout=60)
    return httpx.post(running.base_url + path, json=body, headers=headers, timeout=60)


def assert_error(response, status, code=None, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert param in (error["param"] or "")
    return error


def test_malformed_and_hostile_requests_get_openai_errors(tiny_server):
    endpoint = tiny_server.endpoint
    client, episode = client_for(tiny_server)
    other = endpoint.open_episode()
    key, chat = episode.key, "/chat/completions"
    good = {"model": "tiny", "messages": HELLO, "max_tokens": 2}
    calls = endpoint.batcher.calls
    # keys: none, unknown, another episode's on this episode's URL
    assert_error(post(tiny_server, chat, good), 401, "invalid_api_key")
    assert_error(post(tiny_server, chat, good, key="lmrl-nobody"), 401, "invalid_api_key")
    mixed, _ = client_for(tiny_server, other, base_url=tiny_server.episode_url(episode.id))
    with pytest.raises(openai.AuthenticationError, match="another episode"):
        mixed.chat.completions.create(model="tiny", messages=HELLO)
    # the model
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert info.value.code == "model_not_found"
    # the body
    assert_error(post(tiny_server, chat, None, key, raw=b"{not json"), 400)
    assert_error(post(tiny_server, chat, None, key, raw=b"[1, 2]"), 400)
    assert_error(post(tiny_server, chat, {"model": "tiny"}, key), 400, param="messages")
    assert_error(post(tiny_server, chat, {**good, "messages": []}, key), 400, param="messages")
    for field, value in [("n", 0), ("n", 10**6), ("max_tokens", -1), ("max_tokens", 0),
                         ("temperature", -0.5), ("temperature", 3), ("top_p", 0),
                         ("top_logprobs", 5), ("presence_penalty", 1.0),
                         ("tool_choice", "required"), ("stop", [""])]:  # fmt: skip
        assert_error(post(tiny_server, chat, {**good, field: value}, key), 400), (field, value)
    nan = json.dumps({**good, "temperature": float("nan")}).encode()
    assert_error(post(tiny_server, chat, None, key, raw=nan), 400, param="temperature")
    bad_role = [{"role": "wizard", "content": "hi"}]
    assert_error(post(tiny_server, chat, {**good, "messages": bad_role}, key), 400)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(tiny_server, chat, {**good, "messages": image}, key), 400)
    # over the context length (256): the prompt, or the prompt with max_tokens
    long = [{"role": "user", "content": "x" * 400}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=long)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1000)
    # tools: the tiny template renders none; a call of an undeclared tool
    tool = {"type": "function", "function": {"name": "search", "parameters": {}}}
    assert_error(post(tiny_server, chat, {**good, "tools": [tool]}, key), 400, param="tools")
    bad_args = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "search", "arguments": "{"}}]}]  # fmt: skip
    body = {**good, "messages": bad_args, "tools": [tool]}
    assert_error(post(tiny_server, chat, body, key), 400)
    # completions: ids outside the vocabulary, an empty prompt
    assert_error(post(tiny_server, "/completions", {"model": "tiny", "prompt": [10**9]}, key),
                 400, param="prompt")  # fmt: skip
    assert_error(post(tiny_server, "/completions", {"model": "tiny", "prompt": ""}, key), 400)
    # a body over the limit, an unknown route
    huge = {**good, "messages": [{"role": "user", "content": "y" * 100_000}]}
    assert_error(post(tiny_server, chat, huge, key), 413)
    assert_error(post(tiny_server, "/embeddings", good, key), 404)
    # none of it reached the engine or the capture; the endpoint still answers
    assert endpoint.batcher.calls == calls
    assert endpoint.capture.calls(episode.id) == []
    assert client.chat.completions.create(**good).choices[0].message.content is not None


def test_a_stopping_endpoint_answers_503(tiny_server):
    client, _ = client_for(tiny_server)
    tiny_server.endpoint.stopping = True
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="tiny", messages=HELLO)
        assert info.value.status_code == 503
    finally:
        tiny_server.endpoint.stopping = False


def test_a_closed_episodes_key_is_refused(tiny_server):
    client, episode = client_for(tiny_server)
    tiny_server.endpoint.close_episode(episode.id)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="tiny", messages=HELLO)


# ---------------------------------------------------------------------------- tool calls
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}  # fmt: skip


def script(running, *texts: str) -> None:
    tok = running.endpoint.tokenizer
    for text in texts:
        running.endpoint.engine.script.append(tok.encode(text, add_special_tokens=False))


def test_tool_calls_in_the_templates_syntax_round_trip(scripted_server):
    client, episode = client_for(scripted_server)
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "Paris"}}\n</tool_call>'
    script(scripted_server, f"Let me look.\n{call}<|im_end|>", "In France.<|im_end|>")
    messages = [{"role": "user", "content": "Where is Paris?"}]
    out = client.chat.completions.create(model="scripted", messages=messages, tools=[SEARCH])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "search" and json.loads(tc.function.arguments) == {"query": "Paris"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tc.id, "content": "France"}]  # fmt: skip
    final = client.chat.completions.create(model="scripted", messages=messages, tools=[SEARCH])
    assert final.choices[0].message.content == "In France."
    capture = scripted_server.endpoint.capture
    (trajectory,) = capture.trajectories(episode.id)
    engine = scripted_server.endpoint.engine
    assert engine.prompts[-1] == trajectory.prompt + trajectory.responses[: -len(
        capture.calls(episode.id)[1].choices[0].ids)]  # fmt: skip
    whole = scripted_server.endpoint.renderer.render(
        [*messages[:1], {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": "Paris"}}}]},
         {"role": "tool", "content": "France"},
         {"role": "assistant", "content": "In France."}], [SEARCH], False)  # fmt: skip
    ids = trajectory.prompt + trajectory.responses
    assert whole[: len(ids)] == ids and len(whole) == len(ids) + 1  # the template's last "\n"


def test_a_call_of_an_undeclared_tool_is_refused(scripted_server):
    client, episode = client_for(scripted_server)
    unknown = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "rm_rf", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "done"}]  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="rm_rf"):
        client.chat.completions.create(model="scripted", messages=unknown, tools=[SEARCH])
    stray = [*HELLO, {"role": "tool", "tool_call_id": "zzz", "content": "?"}]
    stray[1:1] = [unknown[1]]
    with pytest.raises(openai.BadRequestError, match="zzz"):
        client.chat.completions.create(model="scripted", messages=stray)
    assert scripted_server.endpoint.capture.calls(episode.id) == []


def test_streamed_tool_calls_and_tool_choice(scripted_server):
    client, _ = client_for(scripted_server)
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
    script(scripted_server, f"{call}<|im_end|>", f"{call}<|im_end|>")
    messages = [{"role": "user", "content": "Go."}]
    chunks = list(client.chat.completions.create(model="scripted", messages=messages,
                                                 tools=[SEARCH], stream=True))  # fmt: skip
    calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        ("search", {"query": "x"})]  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice none: the text is the answer, no call is read from it
    out = client.chat.completions.create(model="scripted", messages=messages, tools=[SEARCH],
                                         tool_choice="none")  # fmt: skip
    assert (
        out.choices[0].message.tool_calls is None
        and "<tool_call>" in out.choices[0].message.content
    )


def test_generated_agent_conversations_through_http_are_token_exact(scripted_server):
    """24 generated conversations (tests/rollout/test_chat_template.py's generator) played
    through the endpoint by the openai client: one trajectory each, equal to the template's
    rendering of the conversation, trained on the sampled ids alone."""
    from tests.rollout.test_chat_template import TOOLS, assistant_spans, conversation

    schemas = [tool.schema() for tool in TOOLS.values()]
    endpoint = scripted_server.endpoint
    r, tok = endpoint.renderer, endpoint.tokenizer
    rng = random.Random("serve-http")
    for k in range(24):
        messages = conversation(rng, "qwen2.5")
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        client, episode = client_for(scripted_server)
        sent = [dict(m) for m in messages[: last + 1]]
        j, sampled = last + 1, []
        while j < len(messages):
            g = r.render(_template(sent), schemas, True)
            s = r.render([*_template(sent), messages[j]], schemas, False)
            tail = s[len(g) :]
            turn = tail[: tail.index(tok.eos_token_id) + 1]
            endpoint.engine.script.append(turn)
            sampled += turn
            out = client.chat.completions.create(model="scripted", messages=sent, tools=schemas)
            message = out.choices[0].message
            sent.append(message.model_dump(exclude_none=True))
            n = len(message.tool_calls or [])
            for tc, result in zip(message.tool_calls or [], messages[j + 1 : j + 1 + n],
                                  strict=True):  # fmt: skip
                sent.append({"role": "tool", "tool_call_id": tc.id, "content": result["content"]})
            j += 1 + n
        (t,) = endpoint.capture.trajectories(episode.id)
        whole = r.render(_template(sent), schemas, False)
        ids = t.prompt + t.responses
        assert whole[: len(ids)] == ids, k
        spans = assistant_spans("qwen2.5", tok, whole)
        assert t.response_mask == spans[len(t.prompt) : len(ids)], k
        assert [x for x, m in zip(t.responses, t.response_mask, strict=True) if m] == sampled
        assert not any(endpoint.capture.splits(episode.id).values())


def _template(sent: list[dict]) -> list[dict]:
    from lmrl.serve.messages import template_messages
    from lmrl.serve.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": n, "parameters": {}}}
             for n in ("search", "calculator")]  # fmt: skip
    return template_messages(ChatCompletionRequest(model="m", messages=sent, tools=tools))


def test_a_port_in_use_is_one_error_and_a_closed_batcher_refuses(scripted_server):
    import asyncio
    import socket

    from tests.serve.conftest import ScriptedEngine

    from lmrl.rollout.base import SamplingParams
    from lmrl.serve import Endpoint, serve_in_thread
    from lmrl.serve.errors import APIError

    tok = scripted_server.endpoint.tokenizer
    endpoint = Endpoint(ScriptedEngine(0), tok, "m", 64, 0, [tok.eos_token_id])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match=r"could not start.*address already in use"):
            serve_in_thread(endpoint, port=taken.getsockname()[1])
    with pytest.raises(APIError) as info:  # the endpoint stopped its batcher
        asyncio.run(endpoint.batcher.generate([[5]], 1, SamplingParams(max_new_tokens=1)))
    assert info.value.status == 503
