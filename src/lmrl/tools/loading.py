"""Making a run's tools by name: the built-ins, or functions and tools from a user's file.

``rollout.multi_turn.tools`` lists the names; ``rollout.multi_turn.tool_path`` is a Python
file (like ``custom_reward_function.path``) where a name that is not built in is looked up.
There a name may be a `Tool` instance, a `Tool` subclass (made with no arguments), or a plain
typed function with a docstring (`function_tool`). With ``processes >= 1`` the file's tools run
in worker processes (`lmrl.tools.processes`), where a call past its timeout is killed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lmrl._userfile import UserFileError, import_user_file
from lmrl.errors import ToolLoadError
from lmrl.tools.base import Tool, user_tool
from lmrl.tools.processes import ProcessTool, ToolPool
from lmrl.tools.python import PythonTool
from lmrl.tools.search import SearchTool

__all__ = ["BUILTIN_TOOLS", "load_tools", "tool_schemas"]

# name -> factory taking that tool's options as keyword arguments
BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {"search": SearchTool, "python": PythonTool}


def _import_file(path: str | Path) -> Any:
    try:
        return import_user_file(path, "lmrl_user_tools")
    except UserFileError as err:
        if str(err).startswith("failed"):
            raise ToolLoadError(f"importing the tool file {str(path)!r} {err}") from err.__cause__
        raise ToolLoadError(f"rollout.multi_turn.tool_path {str(path)!r} {err}") from None


def load_tools(
    names: Sequence[str],
    tool_path: str | Path | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    processes: int = 0,
    timeout_s: float = 30.0,
) -> dict[str, Tool]:
    """Make the named tools.

    Args:
        names: tool names; a built-in (``search``, ``python``) unless ``tool_path`` defines
            the name, which then wins.
        tool_path: a Python file of user tools.
        options: built-in name -> its keyword arguments (``search``: ``corpus``, ``url``,
            ``topk``; ``python``: ``timeout_s``, ``memory_mb``...).
        processes: worker processes for the tools of ``tool_path`` (a `ToolPool` they share);
            0 = they run in the calling process.
        timeout_s: seconds one call of a file's tool may run in its process.

    Returns:
        name -> tool, in the order of ``names``.

    Raises:
        ToolLoadError: an unknown name, a duplicate, a file that fails, a built-in whose
            options are wrong (the message says which tool and why).
    """
    options = options or {}
    module = _import_file(tool_path) if tool_path else None
    tools: dict[str, Tool] = {}
    for name in names:
        if name in tools:
            raise ToolLoadError(f"rollout.multi_turn.tools lists {name!r} twice")
        found = getattr(module, name, None) if module is not None else None
        if found is not None:
            try:
                tool = user_tool(found, name)
            except (ValueError, TypeError) as err:
                raise ToolLoadError(f"tool {name!r} in {tool_path}: {err}") from None
        elif name in BUILTIN_TOOLS:
            try:
                tool = BUILTIN_TOOLS[name](**dict(options.get(name, {})))
            except (ValueError, TypeError) as err:
                raise ToolLoadError(f"the {name} tool: {err}") from None
        else:
            where = f" nor defined in {tool_path}" if tool_path else ""
            hint = (
                "" if tool_path else "; define it in a file given as rollout.multi_turn.tool_path"
            )
            raise ToolLoadError(
                f"unknown tool {name!r}: not built in ({', '.join(BUILTIN_TOOLS)}){where}{hint}"
            )
        tool.name = name
        tools[name] = tool
    from_file = [name for name in names if getattr(module, name, None) is not None]
    if processes and from_file:
        pool = ToolPool(tool_path, from_file, processes, timeout_s)
        for name in from_file:
            tools[name] = ProcessTool(tools[name], pool)
    return tools


def tool_schemas(names: Sequence[str], tool_path: str | Path | None = None) -> list[dict]:
    """The function schemas of the named tools (`Tool.schema`, as `load_tools` would make them
    and the chat template renders them), without starting a built-in (no corpus is read).

    What the prompts are rendered with when the agent loop speaks the chat template
    (``rollout.multi_turn.format=chat``): the template puts the tools into the prompt.

    Raises:
        ToolLoadError: as `load_tools`.
    """
    module = _import_file(tool_path) if tool_path else None
    out = []
    for name in names:
        found = getattr(module, name, None) if module is not None else None
        if found is None and name in BUILTIN_TOOLS:
            cls = BUILTIN_TOOLS[name]
            tool = Tool()  # the built-in's class attributes, without its start-up
            tool.description, tool.parameters = cls.description, cls.parameters
        else:
            tool = next(iter(load_tools([name], tool_path).values()))
        tool.name = name
        out.append(tool.schema())
    return out
