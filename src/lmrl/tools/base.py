"""The tool interface: a name, a description, a JSON schema of its arguments, and a call.

A tool turns arguments (a dict, validated against nothing more than its schema's required
names) into one observation string. Two ways to make one:

- subclass `Tool` (the built-in ``search`` and ``python`` do), or
- hand a plain typed Python function with a Google-style docstring to `function_tool`, as
  TRL's ``tools=[...]`` takes them: its name, first docstring paragraph and ``Args:`` become
  the tool's name, description and schema (``transformers.utils.get_json_schema``).

A tool may also answer many calls at once (`Tool.call_batch`: the search tool scores every
query of a turn in one BM25 pass); the default calls one at a time.

Errors a tool raises are the tool's answer, not the run's end: `lmrl.tools.executor` turns
them into an error observation the policy reads (``Error: ...``). A `ToolError` is the call's
fault (bad arguments, code that raised); a `ToolFault`, any other exception and a timeout are
the tool's, and a first batch whose calls nearly all fail so stops the run
(`lmrl.rollout.agent`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "FunctionTool",
    "Tool",
    "ToolError",
    "ToolFault",
    "ToolTimeout",
    "error_text",
    "function_tool",
    "user_tool",
]


class ToolError(Exception):
    """A call's expected failure (bad arguments, nothing found, code that raised): its message
    becomes the observation, with no traceback. It is the call's fault, not the tool's."""


class ToolFault(ToolError):
    """The tool itself failed, whatever the call (a server down, or answering in the wrong
    shape): an error observation like any `ToolError`, but counted against the tool; the
    agent loop stops a run when nearly every call of its first batch fails this way."""


class ToolTimeout(ToolFault):
    """The tool ran past its own time limit (a server that did not answer): the call's
    result is a ``timeout``, as when the executor's limit stops it."""


def error_text(err: BaseException) -> str:
    """The observation a failed call gives: ``Error: <message>`` for a `ToolError`, else
    ``Error: <Type>: <message>``."""
    if isinstance(err, ToolError):
        return f"Error: {err}"
    return f"Error: {type(err).__name__}: {err}"


class Tool:
    """A tool the policy may call.

    Attributes:
        name: what the policy writes to call it (``<search>...</search>``); letters, digits
            and ``_``.
        description: one line for the prompt / chat template.
        parameters: JSON schema of the arguments (``{"type": "object", "properties": ...,
            "required": [...]}``); the first required property is the one a tag-format call
            (``<name>text</name>``) fills with its text.
    """

    name: str = ""
    description: str = ""
    parameters: Mapping[str, Any] = {"type": "object", "properties": {}, "required": []}

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        """Run one call; return its observation text.

        Raises:
            ToolError: an expected failure, shown to the policy as ``Error: <message>``.
        """
        raise NotImplementedError

    def call_batch(self, calls: Sequence[Mapping[str, Any]]) -> list[str | BaseException]:
        """Run many calls; one observation (or the exception it raised) per call, in order."""
        out: list[str | BaseException] = []
        for arguments in calls:
            try:
                out.append(self(arguments))
            except Exception as err:  # one bad call does not sink the others
                out.append(err)
        return out

    @property
    def main_argument(self) -> str | None:
        """The argument a tag-format call fills: the first required property, else the first."""
        required = list(self.parameters.get("required", []))
        names = list(self.parameters.get("properties", {}))
        return required[0] if required else (names[0] if names else None)

    def schema(self) -> dict[str, Any]:
        """The OpenAI/``transformers`` function schema (``{"type": "function", ...}``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }

    def close(self) -> None:
        """Release what the tool holds (nothing by default)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionTool(Tool):
    """A plain typed Python function as a tool (see `function_tool`)."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        from transformers.utils import get_json_schema

        try:
            spec = get_json_schema(fn)["function"]
        except Exception as err:  # transformers raises its own error types for bad docstrings
            raise ValueError(
                f"tool {getattr(fn, '__name__', fn)!r}: cannot build its schema ({err}); a "
                "tool function needs type hints on every argument and a docstring with an "
                "Args: section"
            ) from None
        self.fn = fn
        self.name = name or spec["name"]
        self.description = spec.get("description", "")
        self.parameters = spec.get("parameters", {"type": "object", "properties": {}})
        self._signature = inspect.signature(fn)

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        try:
            bound = self._signature.bind(**dict(arguments))
        except TypeError as err:
            raise ToolError(f"bad arguments for {self.name}: {err}") from None
        result = self.fn(*bound.args, **bound.kwargs)
        return result if isinstance(result, str) else str(result)


def function_tool(fn: Callable[..., Any] | Tool, name: str | None = None) -> Tool:
    """A `Tool` from a `Tool` (returned as is) or a typed function with a docstring.

    Raises:
        ValueError: the function has no usable schema (missing hints or docstring ``Args:``).
    """
    if isinstance(fn, Tool):
        return fn
    if not callable(fn):
        raise ValueError(f"a tool must be a Tool or a function, got {type(fn).__name__}")
    return FunctionTool(fn, name)


def user_tool(found: Any, name: str) -> Tool:
    """The tool a user's file defines as ``name``: a `Tool` instance, a `Tool` subclass (made
    with no arguments) or a typed function.

    Raises:
        ValueError, TypeError: it is none of these, or its schema cannot be built.
    """
    if inspect.isclass(found) and issubclass(found, Tool):
        found = found()
    return function_tool(found, name)
