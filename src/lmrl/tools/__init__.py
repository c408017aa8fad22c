"""Tools an agent may call during a multi-turn rollout.

`Tool` is the interface (name, description, JSON schema, call); `function_tool` makes one of
a typed Python function; `load_tools` makes a run's tools by name (built in: ``search``,
`SearchTool`, BM25 over a local corpus or a retrieval server; ``python``, `PythonTool`, code
in a sandboxed process); `run_calls` runs one turn's calls together with a timeout, and `CallsInFlight` runs turns of
them in the background.
"""

from lmrl._lazy import lazy_exports

_EXPORTS = {
    "Tool": "lmrl.tools.base",
    "ToolError": "lmrl.tools.base",
    "ToolFault": "lmrl.tools.base",
    "ToolTimeout": "lmrl.tools.base",
    "FunctionTool": "lmrl.tools.base",
    "function_tool": "lmrl.tools.base",
    "ToolCall": "lmrl.tools.executor",
    "ToolResult": "lmrl.tools.executor",
    "run_calls": "lmrl.tools.executor",
    "CallsInFlight": "lmrl.tools.executor",
    "BUILTIN_TOOLS": "lmrl.tools.loading",
    "load_tools": "lmrl.tools.loading",
    "PythonTool": "lmrl.tools.python",
    "SearchTool": "lmrl.tools.search",
    "format_passages": "lmrl.tools.search",
    "load_corpus": "lmrl.tools.search",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
