"""Chat-template multi-turn: the agent loop's tokens are the tokenizer's own chat template.

With ``rollout.multi_turn.format=chat`` a rollout is a chat conversation: the prompt is the
template's rendering of the prompt's messages with the generation prompt, the model writes
an assistant turn up to and including its end-of-turn token (EOS), the turn is read back as
an assistant message (content and tool calls, in the template's own tool-call syntax:
Hermes/Qwen ``<tool_call>{json}</tool_call>``, Llama 3 JSON, Mistral ``[TOOL_CALLS]``), the
calls run, and the tokens appended are the ones the template renders for the tool messages
and the next generation prompt.

Choice: those tokens are a *delta* of the template's own rendering of the whole conversation,
computed at the token level from three renderings of one row's conversation::

    g = render(H, generation prompt)        # what the model saw (cached from the last turn)
    s = render(H + [assistant])             # the assistant message as the last message
    t = render(H + [assistant] + tools, generation prompt)
    cut = len(g) + len(s[len(g):] up to and including its first end-of-turn token)
    check t[:cut] == s[:cut];  delta = t[cut:];  g = t for the next turn

so whatever the template adds after the end-of-turn token (Qwen's ``\\n`` after
``<|im_end|>``), between turns (Llama 3's ``ipython`` header, Qwen's ``<|im_start|>user``,
Mistral's ``[TOOL_RESULTS]``) and the next generation prompt comes from the template, never
from a hand-written string; and a template that renders the conversation's earlier tokens
differently once more messages follow (Qwen3 drops an empty ``<think>`` block of an earlier
turn, Mistral v0.3 moves the system prompt) is caught, not silently mis-tokenized.

`check_template` runs at `AgentLoop` start-up: it replays a probe conversation (system, user,
assistant with a tool call, tool result, assistant answer) the way the loop builds it, the
model writing each assistant message exactly as the template renders it, and compares with
the template's rendering of the whole conversation; a difference is one `ModelError` naming
the first differing token (position, both tokens decoded) and the template's rule that caused
it. ``tests/rollout/test_chat_template.py`` does the same over 1,000 generated conversations
with the templates of Qwen2.5, Qwen3 (thinking), Llama 3.1 and Mistral v0.3.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from lmrl.errors import DataError, ModelError
from lmrl.tools.base import Tool
from lmrl.tools.executor import ToolCall

__all__ = ["SYNTAXES", "ChatFormat", "Conversation", "TemplateMismatch", "check_template"]

log = logging.getLogger(__name__)

#: tokens that end an assistant turn in common templates (besides the tokenizer's EOS)
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<|end|>", "<|endoftext|>")

#: the probe conversation of `check_template` (the assistant turns are the model's)
PROBE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 * 7? Use the calculator."},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should call the calculator.",
        "tool_calls": [
            {
                "type": "function",
                "id": "call00001",
                "function": {"name": "PROBE_TOOL", "arguments": {"expression": "12 * 7"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call00001", "name": "PROBE_TOOL", "content": "84"},
    {
        "role": "assistant",
        "content": "12 * 7 = 84.",
        "reasoning_content": "The tool says 84.",
    },
]


# ---------------------------------------------------------------------------- tool-call syntaxes
def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _call(name: Any, arguments: Any, call_id: str | None = None) -> dict | None:
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        call["id"] = call_id
    return call


def parse_hermes(text: str) -> tuple[str, list[dict] | None]:
    """Hermes/Qwen: ``content\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
    (one block per call). Returns (content, calls); calls None = a block that does not parse."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    content = text[:start].removesuffix("\n")
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text[start:], re.S):
        obj = _json_object(body.strip())
        call = obj and _call(obj.get("name"), obj.get("arguments", {}))
        if not call:
            return content, None
        calls.append(call)
    return content, calls or None


def parse_llama3_json(text: str) -> tuple[str, list[dict] | None]:
    """Llama 3.1: the whole turn is ``{"name": ..., "parameters": {...}}`` (one call)."""
    body = text.strip().removeprefix("<|python_tag|>")
    if not body.startswith("{"):
        return text, []
    obj = _json_object(body)
    if obj is None or "name" not in obj:
        return text, []  # a JSON-looking answer
    call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments", {})))
    return "", [call] if call else None


def parse_mistral(text: str) -> tuple[str, list[dict] | None]:
    """Mistral v0.3: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "9 chars"}]``."""
    body = text.strip()
    if not body.startswith("[TOOL_CALLS]"):
        return body, []
    try:
        items = json.loads(body.removeprefix("[TOOL_CALLS]"))
    except json.JSONDecodeError:
        return "", None
    if not isinstance(items, list) or not items:
        return "", None
    calls = []
    for k, item in enumerate(items):
        if not isinstance(item, dict):
            return "", None
        call_id = item.get("id")
        if not (isinstance(call_id, str) and len(call_id) == 9 and call_id.isalnum()):
            call_id = f"call{k:05d}"  # the template insists on 9 alphanumeric characters
        call = _call(item.get("name"), item.get("arguments", {}), call_id)
        if not call:
            return "", None
        calls.append(call)
    return "", calls


SYNTAXES = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def syntax_of(template: str) -> str:
    """The tool-call syntax a chat template renders (`SYNTAXES`), read off its source."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters": ' in template or "ipython" in template:
        return "llama3_json"
    raise ModelError(
        "agent format chat: cannot tell the tool-call syntax of this chat template (none of "
        "<tool_call>, [TOOL_CALLS], Llama 3's JSON); give ChatFormat(syntax=...) one of "
        f"{sorted(SYNTAXES)}"
    )


# ---------------------------------------------------------------------------- the delta
class TemplateMismatch(ModelError):
    """The template renders a conversation's tokens differently as it grows.

    Attributes:
        position: the first differing token, counted in the whole conversation.
        ours, theirs: that token as the agent loop has it / as the template renders it
            (None: the sequence ends there).
        rule: the template's rule that caused it, in words.
    """

    def __init__(self, tokenizer, position: int, ours, theirs, rule: str, where: str = ""):
        self.position, self.ours, self.theirs, self.rule = position, ours, theirs, rule

        def show(t):
            return "(nothing)" if t is None else f"{tokenizer.decode([t])!r} (id {t})"

        super().__init__(
            f"chat template{where}: token {position} differs: the agent loop has {show(ours)}, "
            f"the template's rendering of the whole conversation has {show(theirs)}: {rule}"
        )

    def __reduce__(self):  # crosses processes (Ray) as the ModelError line it reads
        return ModelError, (str(self),)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _at(ids: Sequence[int], i: int):
    return ids[i] if i < len(ids) else None


class Conversation:
    """One row's conversation as the agent loop builds it (see the module docstring).

    Args:
        fmt: the bound `ChatFormat`.
        messages: the prompt's messages (ending with the user's).
        prompt: the prompt's tokens as the batch has them; when they are not the template's
            rendering of ``messages`` with the tools, `ChatFormat` warns once.
        rendered: that rendering, when known (the rows of one prompt share it).
    """

    def __init__(
        self, fmt: ChatFormat, messages: Sequence[Mapping], prompt=None, rendered=None
    ) -> None:
        self.fmt, self.messages = fmt, [dict(m) for m in messages]
        # what the model sees before its turn (``rendered``: already known)
        self.g = list(rendered) if rendered is not None else fmt.render(self.messages, True)
        if prompt is not None and list(prompt) != self.g:
            fmt.note_prompt(list(prompt), self.g)
        self.part: list[int] = []  # the template's model part of the last assistant turn
        self._s: list[int] = []  # the rendering with the last assistant message last

    def model_part(self, assistant: Mapping) -> list[int]:
        """The tokens the template renders for ``assistant`` after the generation prompt, up
        to and including its end-of-turn token: what a model trained on it writes.

        Raises:
            TemplateMismatch: the generation prompt does not start that rendering, or it has
                no end-of-turn token.
        """
        fmt, g = self.fmt, self.g
        s = fmt.render([*self.messages, dict(assistant)], False)
        if s[: len(g)] != g:
            p = _first_difference(g, s)
            h = fmt.render(self.messages, False)
            gen = len(h) if g[: len(h)] == h else len(g)
            if p < gen:
                rule = "the template re-renders an earlier message once the assistant's follows"
                system = next((m["content"] for m in self.messages if m["role"] == "system"), "")
                if system and system in fmt.decode(g) and system not in fmt.decode(s):
                    rule += (
                        " (it renders the system message only while the user message it goes "
                        "into is the last message of the conversation)"
                    )
            else:
                rule = (
                    f"the template's generation prompt {fmt.decode(g[gen:])!r} is not how it "
                    f"starts the assistant message ({fmt.decode(s[gen : len(g) + 8])!r}...)"
                )
            raise TemplateMismatch(fmt.tokenizer, p, _at(g, p), _at(s, p), rule)
        tail = s[len(g) :]
        end = next((i for i, t in enumerate(tail) if t in fmt.end_ids), None)
        if end is None:
            raise TemplateMismatch(
                fmt.tokenizer, len(s), None, None,
                "the template renders no end-of-turn token after the last assistant message "
                f"(known: {sorted(fmt.decode([t]) for t in fmt.end_ids)})",
            )  # fmt: skip
        self._s = s
        return tail[: end + 1]

    def assistant(self, tokens: Sequence[int], strict: bool = False) -> list[ToolCall] | None:
        """Read the model's turn (``tokens``, up to and including its end-of-turn token) back
        as an assistant message and add it.

        Returns:
            Its calls: [] = an answer, None = a tool call that does not parse (the row ends).

        Raises:
            TemplateMismatch: (``strict``) a turn with calls that the template renders
                otherwise once read back (else a warning, once: the model's tokens stay).
        """
        fmt, tokens = self.fmt, list(tokens)
        ids = tokens[:-1] if tokens and tokens[-1] in fmt.end_ids else tokens
        content, calls = fmt.parse(fmt.decode(ids))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            self.part = self.model_part(message)
            if self.part != tokens:
                p = _first_difference(tokens, self.part)
                if strict:
                    p += len(self.g)
                    raise TemplateMismatch(
                        fmt.tokenizer, p, _at(tokens, p - len(self.g)), _at(self._s, p),
                        f"the chat format ({fmt.syntax}) reads the assistant turn back as a "
                        "message the template renders otherwise (its tool-call syntax?)",
                    )  # fmt: skip
                fmt.note_drift(tokens, self.part, p)
        self.messages.append(message)
        if calls is None:
            return None
        return [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in calls]

    def observe(self, texts: Sequence[str], most: int | None = None) -> list[int]:
        """Add one tool message per call of the last assistant turn (``texts`` in call order,
        each cut to ``most`` tokens, its head kept; None = whole; `lmrl.rollout.agent`
        cuts them by characters first).

        Returns:
            The tokens the template renders for them and the next generation prompt.

        Raises:
            TemplateMismatch: the template renders the conversation up to the end of the
                assistant's turn differently once the tool messages follow (the rule named).
        """
        fmt, assistant = self.fmt, self.messages[-1]
        calls = assistant.get("tool_calls") or []
        if len(texts) != len(calls):
            raise ValueError(f"{len(texts)} tool results for a turn of {len(calls)} calls")
        for call, text in zip(calls, texts, strict=True):
            if most is not None:
                ids = fmt.tokenizer.encode(text, add_special_tokens=False)
                text = text if len(ids) <= most else fmt.decode(ids[:most])
            tool = {"role": "tool", "name": call["function"]["name"], "content": text}
            if "id" in call:
                tool["tool_call_id"] = call["id"]
            self.messages.append(tool)
        s, t = self._s, fmt.render(self.messages, True)
        start, cut = len(self.g), len(self.g) + len(self.part)
        if t[:cut] != s[:cut]:
            p = _first_difference(s[:cut], t)
            raise TemplateMismatch(
                fmt.tokenizer, p, _at(s, p), _at(t, p), self._rule(s, t, p, start, cut)
            )
        self.g = t
        return t[cut:]

    def _rule(self, s: list[int], t: list[int], p: int, start: int, cut: int) -> str:
        """Which of the template's rules re-renders token ``p`` (the assistant's message is
        ``s[start:cut]``, after its generation prompt) once tool messages follow it."""
        fmt, k = self.fmt, 1
        while self.messages[-k]["role"] == "tool":
            k += 1
        h = len(fmt.render(self.messages[:-k], False))  # where the generation prompt starts
        if p < h:
            return "the template re-renders an earlier message once tool messages follow"
        mine, later = fmt.decode(s[h:cut]), fmt.decode(t[h:])
        if "<think>" in mine and "<think>" not in later[: len(mine)]:
            return "the template re-renders earlier assistant turns without their <think> block" + (
                " (here the empty one its generation prompt opens)" if p < start else ""
            )
        if p < start:
            return (
                "the template renders an earlier turn's generation prompt otherwise once tool "
                "messages follow"
            )
        if s[p] in fmt.end_ids:
            return (
                "the template ends an earlier assistant turn with another token than the "
                "end-of-turn token the model generates"
            )
        a, b = fmt.decode(s[p : p + 1]), fmt.decode(t[p : p + 1])
        if a.isspace() or b.isspace():
            return (
                "the template renders whitespace in an earlier assistant turn otherwise once "
                f"tool messages follow ({a!r} vs {b!r})"
            )
        return "the template re-renders earlier assistant turns otherwise once tool messages follow"


# ---------------------------------------------------------------------------- the format
class ChatFormat:
    """The chat-template call format (``format="chat"``): a turn ends at its end-of-turn
    token, its tool calls are read in the template's own syntax, and the observation is the
    template's delta (tool messages and the next generation prompt).

    Args:
        syntax: the tool-call syntax (`SYNTAXES`); None = read off the template.
        template_kwargs: extra ``apply_chat_template`` arguments (``enable_thinking``...).
        tokenizer, tools, eos_ids: bind at once (else `AgentLoop` calls `bind`).
    """

    name = "chat"

    def __init__(
        self,
        syntax: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tokenizer=None,
        tools: Mapping[str, Tool] | None = None,
        eos_ids: Sequence[int] = (),
    ) -> None:
        if syntax is not None and syntax not in SYNTAXES:
            raise ValueError(f"unknown tool-call syntax {syntax!r}; known: {sorted(SYNTAXES)}")
        self.syntax, self.template_kwargs = syntax, dict(template_kwargs or {})
        self.tokenizer: Any = None  # a Hugging Face tokenizer, once bound (`bind`)
        self.tool_schemas: list[dict[str, Any]] | None = None
        self.end_ids: frozenset[int] = frozenset()
        self._noted: set[str] = set()
        if tokenizer is not None:
            self.bind(tokenizer, tools or {}, eos_ids, check=False)

    def bind(
        self, tokenizer, tools: Mapping[str, Tool], eos_ids: Sequence[int] = (), check=True
    ) -> None:
        """Use ``tokenizer``'s chat template with ``tools`` rendered into it; end-of-turn
        tokens: ``eos_ids``, the tokenizer's EOS and the `END_OF_TURN` it has.

        Raises:
            ModelError: no chat template, an unknown tool-call syntax, or (``check``)
                `check_template` fails.
        """
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ModelError("agent format chat needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.syntax = self.syntax or syntax_of(template)
        self.tool_schemas = [tool.schema() for tool in tools.values()] or None
        vocab = tokenizer.get_vocab()
        ends = {vocab[t] for t in END_OF_TURN if t in vocab} | {int(t) for t in eos_ids}
        if tokenizer.eos_token_id is not None:
            ends.add(int(tokenizer.eos_token_id))
        self.end_ids = frozenset(ends)
        if check:
            check_template(self)

    def parse(self, text: str) -> tuple[str, list[dict] | None]:
        """(content, tool calls) of an assistant turn's text (`SYNTAXES`)."""
        assert self.syntax is not None  # given, or read off the template by `bind`
        return SYNTAXES[self.syntax](text)

    def stops(self, tools: Mapping[str, Tool]) -> list[str]:
        return []  # a turn ends at its end-of-turn token

    def render(self, messages: Sequence[Mapping], generation: bool) -> list[int]:
        """The template's tokens of ``messages`` (``generation``: with the generation prompt)."""
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tool_schemas,
            add_generation_prompt=generation,
            tokenize=False,
            **self.template_kwargs,
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _note(self, key: str, message: str, *args) -> None:
        if key not in self._noted:
            self._noted.add(key)
            log.warning(message, *args)

    def note_drift(self, tokens: list[int], part: list[int], p: int) -> None:
        """Warn once that a turn is not what the template renders for its parsed message."""
        self._note(
            "drift",
            "agent format chat: a turn differs from the template's rendering of the message "
            "read from it at its token %d (%r vs %r); the rollout keeps the model's tokens",
            p, self.decode(tokens[p : p + 4]), self.decode(part[p : p + 4]),
        )  # fmt: skip

    def note_prompt(self, prompt: list[int], rendered: list[int]) -> None:
        """Warn once that a prompt is not the template's rendering of its messages."""
        p = _first_difference(prompt, rendered)
        self._note(
            "prompt",
            "agent format chat: a prompt's tokens are not the chat template's rendering of its "
            "messages%s (from token %d: %r vs %r); the turns are rendered after the template's",
            " with the tools" if self.tool_schemas else "",
            p, self.decode(prompt[p : p + 6]), self.decode(rendered[p : p + 6]),
        )  # fmt: skip

    def conversations(self, prompts, n: int, rows) -> list[Conversation]:
        """One `Conversation` per rollout row (``rows`` (R,) of the ``B * n``), from the
        prompts' ``raw_prompt`` messages.

        Raises:
            DataError: a prompt without chat messages.
        """
        raw = prompts.get("raw_prompt")
        mask = prompts["attention_mask"].bool()
        out: list[Conversation] = []
        seen: dict[int, list[int]] = {}  # a prompt's rendering, shared by its rows
        for r in rows.tolist():
            p = r // n
            messages = None if raw is None else raw[p]
            if messages is None or isinstance(messages, str) or not len(messages):
                raise DataError(
                    "agent format chat needs each prompt's chat messages (the batch column "
                    f"raw_prompt, as lmrl's datasets give); prompt {p} has {messages!r:.60}"
                )
            ids = prompts["input_ids"][p][mask[p]].tolist()
            out.append(Conversation(self, [dict(m) for m in messages], ids, seen.get(p)))
            seen[p] = out[-1].g
        return out


# ---------------------------------------------------------------------------- the check
def replay(fmt: ChatFormat, messages: Sequence[Mapping]) -> tuple[list[int], list[bool]]:
    """Build ``messages`` the way the agent loop does, the model writing each assistant
    message after the last user message as the template renders it there.

    Returns:
        (ids, sampled): the loop's tokens, prompt included, and True on the model's tokens.

    Raises:
        TemplateMismatch: a step of the build disagrees with the template (the rule named).
    """
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    conv = Conversation(fmt, messages[: last_user + 1])
    ids = list(conv.g)
    sampled = [False] * len(ids)
    j = last_user + 1
    while j < len(messages):
        part = conv.model_part(messages[j])
        ids, sampled = ids + part, sampled + [True] * len(part)
        k = j + 1
        while k < len(messages) and messages[k]["role"] == "tool":
            k += 1
        calls = conv.assistant(part, strict=k > j + 1)
        if k == j + 1:
            break
        if calls is None or len(calls) != k - j - 1:
            raise TemplateMismatch(
                fmt.tokenizer, len(conv.g), part[0] if part else None, part[0] if part else None,
                f"the chat format ({fmt.syntax}) reads {len(calls or [])} tool calls in the "
                f"assistant turn, not {k - j - 1}: the template's tool-call syntax is not it",
            )  # fmt: skip
        delta = conv.observe([m["content"] for m in messages[j + 1 : k]])
        ids, sampled = ids + delta, sampled + [False] * len(delta)
        j = k
    return ids, sampled


def probe(fmt: ChatFormat, system: bool = True) -> list[dict]:
    """`PROBE` for ``fmt``: its tool named after the first bound tool; reasoning only for a
    template with ``<think>`` and thinking on; without the system message unless ``system``."""
    name = fmt.tool_schemas[0]["function"]["name"] if fmt.tool_schemas else "calculator"
    thinking = "<think>" in fmt.tokenizer.chat_template
    thinking &= fmt.template_kwargs.get("enable_thinking", True) is not False
    messages = json.loads(json.dumps(PROBE).replace("PROBE_TOOL", name))
    for m in messages:
        if not thinking:
            m.pop("reasoning_content", None)
    return messages if system else messages[1:]


def check_template(fmt: ChatFormat, messages: Sequence[Mapping] | None = None) -> None:
    """Replay ``messages`` (default: `probe`) as the agent loop builds them and compare with
    the template's rendering of the whole conversation (up to the last end-of-turn token).

    A template that fails the probe only through its system message (Mistral v0.3 renders it
    into the last user message only) passes with a warning: rows whose prompt has a system
    message then fail when their first tool call is read.

    Raises:
        ModelError: one line naming the first differing token (position, both decoded) and
            the template's rule that caused it.
    """
    try:
        _check(fmt, messages or probe(fmt))
    except TemplateMismatch as err:
        if messages is not None or "system message" not in err.rule:
            raise
        _check(fmt, probe(fmt, system=False))
        log.warning("agent format chat: %s; prompts with a system message cannot be used", err)


def _check(fmt: ChatFormat, messages: Sequence[Mapping]) -> None:
    try:
        ids, _ = replay(fmt, messages)
        whole = fmt.render(messages, False)
    except TemplateMismatch as err:
        raise TemplateMismatch(
            fmt.tokenizer, err.position, err.ours, err.theirs, err.rule, " check"
        ) from None
    except Exception as err:  # the template itself refuses the probe
        raise ModelError(f"chat template check: the template fails on the probe: {err}") from err
    if whole[: len(ids)] != ids:
        p = _first_difference(ids, whole)
        raise TemplateMismatch(
            fmt.tokenizer, p, _at(ids, p), _at(whole, p),
            "the template renders the whole conversation otherwise than turn by turn", " check",
        )  # fmt: skip
