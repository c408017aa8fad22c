"""OpenAI's chat messages to and from the model's chat template.

Requests carry messages in OpenAI's wire form; the template takes them in ``transformers``'
form. `template_messages` converts: a content list becomes its text, ``developer`` becomes
``system``, a tool call's JSON ``arguments`` string becomes the object the template renders
(``tojson``), a tool message gets its call's function name. A completion goes the other way
(`Renderer.reply`): its tokens are decoded, cut at the first stop string, and read for tool
calls in the template's own syntax (`lmrl.rollout.chat.SYNTAXES`: Hermes/Qwen
``<tool_call>``, Llama 3 JSON, Mistral ``[TOOL_CALLS]``), the calls answered with ids of nine
letters and digits (what Mistral's template insists on) unless the model wrote its own.

`canonical` is one message (or a conversation's prefix) as a string that the capture compares:
an agent that sends back the assistant message it was given, in any of the client's shapes,
gives the same string.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmrl.errors import ModelError
from lmrl.rollout.chat import END_OF_TURN, SYNTAXES, syntax_of
from lmrl.serve.errors import bad_request
from lmrl.serve.protocol import ChatCompletionRequest, Message

__all__ = ["Renderer", "Reply", "canonical", "template_messages", "tool_schemas"]

_ID_CHARS = string.ascii_letters + string.digits


def _text(message: Message, k: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{k}]: content part of type {part.type!r} is not supported (text only)",
                param=f"messages.{k}.content",
            )
        parts.append(part.text)
    return "".join(parts)


def _arguments(raw: str | dict, k: int) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError as err:
        raise bad_request(
            f"messages[{k}]: a tool call's arguments are not JSON ({err.msg})",
            param=f"messages.{k}.tool_calls",
        ) from None
    if not isinstance(value, dict):
        raise bad_request(
            f"messages[{k}]: a tool call's arguments must be a JSON object",
            param=f"messages.{k}.tool_calls",
        )
    return value


def tool_schemas(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as the template renders them (None: no tools)."""
    if not request.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages in the template's form.

    Raises:
        APIError: 400 for a content part that is not text, tool-call arguments that are not a
            JSON object, a call of a tool the request's tools do not declare (a request
            without tools may hold earlier calls), or a tool message answering no call.
    """
    known = {tool.function.name for tool in request.tools or []}
    names: dict[str, str] = {}  # call id -> function name
    out: list[dict[str, Any]] = []
    for k, message in enumerate(request.messages):
        role = "system" if message.role == "developer" else message.role
        m: dict[str, Any] = {"role": role, "content": _text(message, k)}
        if role == "assistant" and message.tool_calls:
            calls = []
            for call in message.tool_calls:
                name = call.function.name
                if known and name not in known:
                    raise bad_request(
                        f"messages[{k}] calls the tool {name!r}, which the request's tools do "
                        f"not declare (declared: {sorted(known)})",
                        param=f"messages.{k}.tool_calls",
                    )
                c: dict[str, Any] = {
                    "type": "function",
                    "function": {"name": name, "arguments": _arguments(call.function.arguments, k)},
                }
                if call.id is not None:
                    c["id"] = call.id
                    names[call.id] = name
                calls.append(c)
            m["tool_calls"] = calls
        if role == "assistant" and message.reasoning_content is not None:
            m["reasoning_content"] = message.reasoning_content
        if role == "tool":
            if message.tool_call_id is not None:
                if names and message.tool_call_id not in names:
                    raise bad_request(
                        f"messages[{k}] answers the tool call {message.tool_call_id!r}, which no "
                        "earlier assistant message made",
                        param=f"messages.{k}.tool_call_id",
                    )
                m["tool_call_id"] = message.tool_call_id
            answered = message.name or names.get(message.tool_call_id or "")
            if answered:
                m["name"] = answered
        elif message.name is not None:
            m["name"] = message.name
        out.append(m)
    return out


def canonical(messages: Sequence[Mapping[str, Any]], tools=None, kwargs=None) -> str:
    """One string for a conversation (template form) with its tools and template arguments."""
    return json.dumps([tools, kwargs, list(messages)], sort_keys=True, ensure_ascii=False)


@dataclass
class Reply:
    """One choice of a chat completion read back.

    Attributes:
        message: the assistant message in the template's form (arguments as objects).
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        text: the completion's text (before tool-call parsing, cut at a stop string).
    """

    message: dict[str, Any]
    finish_reason: str
    text: str

    def wire(self) -> dict[str, Any]:
        """The message in OpenAI's wire form (arguments as a JSON string)."""
        m = self.message
        out: dict[str, Any] = {"role": "assistant", "content": m["content"]}
        if m.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ]
            out["content"] = m["content"] or None
        return out


class Renderer:
    """A tokenizer's chat template: renders conversations, reads completions back.

    Args:
        tokenizer: a Hugging Face tokenizer (with a chat template for chat requests).
        end_ids: ids that end an assistant turn besides the template's (the engine's EOS).
    """

    def __init__(self, tokenizer, end_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.template = template if isinstance(template, str) and template else None
        try:
            self.syntax: str | None = syntax_of(self.template) if self.template else None
        except ModelError:
            self.syntax = None  # the template renders no tool calls
        vocab = tokenizer.get_vocab()
        ends = {vocab[t] for t in END_OF_TURN if t in vocab} | {int(t) for t in end_ids}
        if tokenizer.eos_token_id is not None:
            ends.add(int(tokenizer.eos_token_id))
        self.end_ids = frozenset(ends)

    def render(
        self, messages: Sequence[Mapping], tools, generation: bool, kwargs=None
    ) -> list[int]:
        """The template's tokens of ``messages`` (``generation``: with the generation prompt).

        Raises:
            APIError: 400 when the tokenizer has no chat template or the template refuses
                the conversation (its own message).
        """
        if self.template is None:
            raise bad_request("this model's tokenizer has no chat template: use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=tools,
                add_generation_prompt=generation,
                tokenize=False,
                **(kwargs or {}),
            )
        except Exception as err:  # the template's raise_exception, a missing field
            raise bad_request(f"the chat template refuses these messages: {err}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def text(self, ids: Sequence[int], stop: Sequence[str]) -> tuple[str, str]:
        """(text, finish reason) of a completion: its end-of-turn token left out, the text
        cut before the first stop string (``stop``), else ``length``."""
        ids = list(ids)
        if ids and ids[-1] in self.end_ids:
            return self.decode(ids[:-1]), "stop"
        text = self.decode(ids)
        cuts = [text.find(s) for s in stop if s in text]
        if cuts:
            return text[: min(cuts)], "stop"
        return text, "length"

    def reply(
        self, ids: Sequence[int], stop: Sequence[str], tools: bool, finished: bool = True
    ) -> Reply:
        """Read a completion back as an assistant message.

        Args:
            ids: the sampled ids.
            stop: the request's stop strings.
            tools: parse tool calls (the request has tools and ``tool_choice`` is not
                ``none``).
            finished: False when the completion was cut at the request's ``max_tokens``.
        """
        text, reason = self.text(ids, stop)
        if not finished:
            reason = "length"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tools and self.syntax is not None and reason == "stop":
            content, calls = SYNTAXES[self.syntax](text)
            if calls:  # None: a call that does not parse stays text
                message["content"] = content
                message["tool_calls"] = [
                    {
                        "type": "function",
                        "id": c.get("id") or self.call_id(),
                        "function": c["function"],
                    }
                    for c in calls
                ]
                reason = "tool_calls"
        return Reply(message, reason, text)

    @staticmethod
    def call_id() -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
