"""The request shapes of the endpoint, typed field for field after OpenAI's API.

``ChatCompletionRequest`` (``POST /v1/chat/completions``) and ``CompletionRequest``
(``POST /v1/completions``) validate what they take: a wrong type, an unknown role, a
temperature that is not a finite number in [0, 2], ``n`` out of [1, ``MAX_N``], a non-positive
``max_tokens`` are answered 400 by the app. Fields an agent's client sends that change nothing
here (``user``, ``metadata``, ``store``, ``parallel_tool_calls``...) are ignored; fields whose
effect the engine cannot give (penalties, ``logit_bias``, top log-probs, constrained tool
choice, JSON mode) are refused with a message rather than ignored (`unsupported`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_N",
    "ChatCompletionRequest",
    "CompletionRequest",
    "Message",
    "unsupported",
]

#: the most samples one request may ask for
MAX_N = 64

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Tokens = Annotated[int, Field(ge=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class _Lenient(BaseModel):
    """Unknown fields are ignored (clients send many that change nothing here)."""

    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Lenient):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: Tokens | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    # extensions of vLLM's API that lmrl's engine has
    top_k: Annotated[int, Field(ge=-1)] | None = None
    ignore_eos: bool = False

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_completion_tokens: Tokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extension: arguments of the chat template (``enable_thinking``...)
    chat_template_kwargs: dict[str, Any] | None = None

    def most_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def most_tokens(self) -> int | None:
        return self.max_tokens


def unsupported(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """``(field, why)`` of the first field asking for what the engine cannot do, or None."""
    if request.presence_penalty or request.frequency_penalty:
        return "presence_penalty", "penalties are not applied by lmrl's engine; leave them 0"
    if request.logit_bias:
        return "logit_bias", "logit_bias is not applied by lmrl's engine"
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs:
            return "top_logprobs", (
                "top log-probs are not computed: logprobs=true gives each sampled token's "
                "log-prob (top_logprobs 0)"
            )
        choice = request.tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            return "tool_choice", (
                "the engine does not constrain decoding to a tool call: use tool_choice "
                "'auto' or 'none'"
            )
        kind = (request.response_format or {}).get("type", "text")
        if kind != "text":
            return "response_format", (
                f"response_format {kind!r} is not enforced by lmrl's engine; use 'text'"
            )
    else:
        if request.logprobs:
            return "logprobs", (
                "top log-probs are not computed: logprobs=0 gives each sampled token's log-prob"
            )
        if request.echo:
            return "echo", "echo is not supported"
        if request.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if request.best_of not in (None, 1, request.n):
            return "best_of", "best_of is not supported; use n"
    return None
