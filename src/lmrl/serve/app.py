"""The OpenAI-compatible app: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, also under ``/episodes/<id>/v1`` (a key of another episode is refused).

`build_app` makes one FastAPI app over an `lmrl.serve.endpoint.Endpoint`. Why FastAPI on
uvicorn: the ASGI pair most maintained and most used for exactly this (vLLM's and SGLang's
OpenAI servers), async handlers so that many agents' requests wait on the batcher at once
without a thread each, and server-sent events through a plain streaming response.

A request's way: its key names its episode (`lmrl.serve.keys`); its body is parsed and
validated (`lmrl.serve.protocol`: 400 in OpenAI's error shape for anything malformed, 413 for
a body over ``max_body_bytes``); the model must be the served one (404); the messages are
rendered, or the prompt extended, by the capture (`lmrl.serve.capture`); a prompt that leaves
no room under the context length is 400 ``context_length_exceeded``; the batcher samples; the
capture records the call; the answer is JSON, or server-sent events when ``stream`` is set
(the completion is sampled whole, then sent as chunks: the role, the content with its
log-probs, the tool calls, the finish reason, the usage when asked, ``[DONE]``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from lmrl.rollout.base import SamplingParams
from lmrl.serve.batcher import Sample
from lmrl.serve.capture import Choice
from lmrl.serve.errors import APIError, bad_request, not_found, over_context, stopping, too_large
from lmrl.serve.messages import canonical, template_messages, tool_schemas
from lmrl.serve.protocol import ChatCompletionRequest, CompletionRequest, unsupported

if TYPE_CHECKING:
    from lmrl.serve.endpoint import Endpoint

__all__ = ["build_app"]

log = logging.getLogger("lmrl.serve")


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _validation(err: ValidationError) -> APIError:
    first = err.errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ()))
    return bad_request(
        f"{where}: {first.get('msg', 'invalid')}" if where else str(err), param=where or None
    )


async def _body(endpoint: Endpoint, request: Request) -> dict[str, Any]:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > endpoint.max_body_bytes:
        raise too_large(f"the request body is {size} bytes, over {endpoint.max_body_bytes}")
    raw = await request.body()
    if len(raw) > endpoint.max_body_bytes:
        raise too_large(f"the request body is over {endpoint.max_body_bytes} bytes")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"the request body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _sampling(endpoint: Endpoint, req, prompt_len: int) -> SamplingParams:
    room = endpoint.context_length - prompt_len
    if room < 1:
        raise over_context(
            f"the prompt is {prompt_len} tokens, and this model's context length is "
            f"{endpoint.context_length}: shorten the messages",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
        )
    most = req.most_tokens()
    if most is not None and most > room:
        raise over_context(
            f"the prompt is {prompt_len} tokens and max_tokens {most}: over this model's "
            f"context length {endpoint.context_length} (at most {room} tokens fit)",
            param="max_tokens",
        )
    temperature = 1.0 if req.temperature is None else req.temperature
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            max_new_tokens=most or room,
            do_sample=temperature > 0,
            stop=req.stops(),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )
    except ValueError as err:
        raise bad_request(str(err)) from None


def _check(endpoint: Endpoint, req) -> None:
    if req.model != endpoint.model_name:
        raise not_found(
            f"the model {req.model!r} does not exist: this endpoint serves {endpoint.model_name!r}",
            param="model",
            code="model_not_found",
        )
    problem = unsupported(req)
    if problem is not None:
        raise bad_request(problem[1], param=problem[0])


def _usage(prompt_tokens: int, samples: list[Sample]) -> dict[str, int]:
    completion = sum(len(s.ids) for s in samples)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _chat_logprobs(endpoint: Endpoint, sample: Sample) -> dict[str, Any]:
    pieces = [endpoint.renderer.decode([t]) for t in sample.ids]
    return {
        "content": [
            {
                "token": piece,
                "logprob": lp,
                "bytes": list(piece.encode("utf-8", "replace")),
                "top_logprobs": [],
            }
            for piece, lp in zip(pieces, sample.log_probs, strict=True)
        ]
    }


def _sse(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
    def events() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _chat(endpoint: Endpoint, episode: str, body: dict[str, Any]):
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as err:
        raise _validation(err) from None
    _check(endpoint, req)
    renderer, capture = endpoint.renderer, endpoint.capture
    messages = template_messages(req)
    tools = tool_schemas(req)
    if tools and renderer.syntax is None:
        raise bad_request(
            "this model's chat template renders no tool calls (none of <tool_call>, "
            "[TOOL_CALLS], Llama 3's JSON): send the request without tools",
            param="tools",
        )
    kwargs = req.chat_template_kwargs or None
    if capture is not None:
        prompt = capture.chat_prompt(episode, messages, tools, kwargs)
        ids = prompt.ids
    else:
        prompt, ids = None, renderer.render(messages, tools, True, kwargs)
    sampling = _sampling(endpoint, req, len(ids))
    samples, version = await endpoint.batcher.generate([ids], req.n, sampling)
    parse = bool(tools) and req.tool_choice != "none"
    replies = [renderer.reply(s.ids, sampling.stop, parse, not s.cut) for s in samples]
    if capture is not None and prompt is not None:
        choices = [
            Choice(s.ids, s.log_probs, ended=bool(s.ids) and s.ids[-1] in renderer.end_ids)
            for s in samples
        ]
        keys = [canonical([*messages, r.message], tools, kwargs) for r in replies]
        capture.record(episode, prompt, choices, version, keys)
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": endpoint.model_name,
        "system_fingerprint": f"weights-v{version}",
    }
    usage = _usage(len(ids), samples)
    if not req.stream:
        return JSONResponse(
            {
                **head,
                "object": "chat.completion",
                "usage": usage,
                "choices": [
                    {
                        "index": j,
                        "message": r.wire(),
                        "finish_reason": r.finish_reason,
                        "logprobs": _chat_logprobs(endpoint, s) if req.logprobs else None,
                    }
                    for j, (r, s) in enumerate(zip(replies, samples, strict=True))
                ],
            }
        )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunks() -> Iterator[dict[str, Any]]:
        def chunk(j: int, delta: dict, finish=None, logprobs=None) -> dict[str, Any]:
            return {
                **head,
                "object": "chat.completion.chunk",
                "choices": [
                    {"index": j, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }

        for j, (r, s) in enumerate(zip(replies, samples, strict=True)):
            wire = r.wire()
            yield chunk(j, {"role": "assistant", "content": ""})
            if wire.get("content") or req.logprobs:
                yield chunk(
                    j,
                    {"content": wire.get("content") or ""},
                    logprobs=_chat_logprobs(endpoint, s) if req.logprobs else None,
                )
            if wire.get("tool_calls"):
                calls = [{"index": i, **c} for i, c in enumerate(wire["tool_calls"])]
                yield chunk(j, {"tool_calls": calls})
            yield chunk(j, {}, finish=r.finish_reason)
        if include_usage:
            yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}

    return _sse(chunks())


def _token_prompts(endpoint: Endpoint, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        lists = [endpoint.tokenizer.encode(p, add_special_tokens=False)]
    elif isinstance(p[0], str):
        lists = [endpoint.tokenizer.encode(x, add_special_tokens=False) for x in p]
    elif isinstance(p[0], int):
        lists = [list(p)]
    else:
        lists = [list(x) for x in p]
    vocab = len(endpoint.tokenizer)
    for ids in lists:
        if not ids:
            raise bad_request("an empty prompt: give at least one token", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt"
            )
    return lists


async def _completion(endpoint: Endpoint, episode: str, body: dict[str, Any]):
    try:
        req = CompletionRequest.model_validate(body)
    except ValidationError as err:
        raise _validation(err) from None
    _check(endpoint, req)
    renderer, capture = endpoint.renderer, endpoint.capture
    prompts = _token_prompts(endpoint, req)
    plans = [capture.completion_prompt(episode, ids) for ids in prompts] if capture else None
    sampling = _sampling(endpoint, req, max(len(ids) for ids in prompts))
    samples, version = await endpoint.batcher.generate(prompts, req.n, sampling)
    texts = [renderer.text(s.ids, sampling.stop) for s in samples]
    if capture is not None and plans is not None:
        for i, plan in enumerate(plans):
            mine = samples[i * req.n : (i + 1) * req.n]
            capture.record(
                episode,
                plan,
                [
                    Choice(s.ids, s.log_probs, ended=bool(s.ids) and s.ids[-1] in renderer.end_ids)
                    for s in mine
                ],
                version,
            )

    def choice(j: int, s: Sample, text: str, reason: str) -> dict[str, Any]:
        logprobs = None
        if req.logprobs is not None:
            pieces = [renderer.decode([t]) for t in s.ids]
            offsets = [sum(len(x) for x in pieces[:k]) for k in range(len(pieces))]
            logprobs = {
                "tokens": pieces,
                "token_logprobs": s.log_probs,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        return {
            "index": j,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": "length" if s.cut else reason,
        }

    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": endpoint.model_name,
        "system_fingerprint": f"weights-v{version}",
    }
    usage = _usage(sum(len(p) for p in prompts), samples)
    out = [choice(j, s, *t) for j, (s, t) in enumerate(zip(samples, texts, strict=True))]
    if not req.stream:
        return JSONResponse({**head, "object": "text_completion", "choices": out, "usage": usage})
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunks() -> Iterator[dict[str, Any]]:
        for c in out:
            yield {**head, "object": "text_completion", "choices": [c]}
        if include_usage:
            yield {**head, "object": "text_completion", "choices": [], "usage": usage}

    return _sse(chunks())


def build_app(endpoint: Endpoint) -> FastAPI:
    """The FastAPI app over ``endpoint`` (see the module docstring)."""
    app = FastAPI(title="lmrl", docs_url=None, redoc_url=None, openapi_url=None)
    router = APIRouter()

    def episode_of(request: Request) -> str:
        if endpoint.stopping:
            raise stopping()
        return endpoint.keys.episode(
            request.headers.get("authorization"), request.path_params.get("episode")
        )

    @router.get("/models")
    async def models(request: Request):
        episode_of(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": endpoint.model_name,
                    "object": "model",
                    "created": endpoint.created,
                    "owned_by": "lmrl",
                    "max_model_len": endpoint.context_length,
                }
            ],
        }

    @router.post("/chat/completions")
    async def chat(request: Request):
        episode = episode_of(request)
        return await _chat(endpoint, episode, await _body(endpoint, request))

    @router.post("/completions")
    async def completions(request: Request):
        episode = episode_of(request)
        return await _completion(endpoint, episode, await _body(endpoint, request))

    app.include_router(router, prefix="/v1")
    app.include_router(router, prefix="/episodes/{episode}/v1")

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return _error(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        message = f"{request.method} {request.url.path}: {err.detail}"
        return _error(APIError(err.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception):
        log.exception("the endpoint failed on %s %s", request.method, request.url.path)
        return _error(
            APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error")
        )

    return app
