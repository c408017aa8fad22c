"""Lazy package exports (PEP 562): a name's module is imported on first use.

``lmrl.algos``, ``lmrl.data`` and ``lmrl.rewards`` use it so that importing one light module
of theirs (reward worker processes import only the scorers) never pays for torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``; ``exports`` maps name -> module path."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
