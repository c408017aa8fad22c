"""Importing a user's Python file by path (a reward function's, a tool file's): a leaf every
package may use, importing nothing of lmrl."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


class UserFileError(Exception):
    """The file is missing, is not Python, or raised while importing (``__cause__`` holds the
    error it raised); callers turn it into their own error with their own words."""


def import_user_file(path: str | Path, prefix: str) -> ModuleType:
    """Import ``path`` as a module named ``<prefix>_<hash of the path>`` (kept in
    ``sys.modules``, so pickling by reference and a second import find it).

    Raises:
        UserFileError: ``"does not exist"``, ``"is not a Python file"``, or ``"failed:
            <Type>: <message>"`` (the import's own error chained).
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise UserFileError("does not exist")
    name = f"{prefix}_{abs(hash(str(path))):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserFileError("is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise UserFileError(f"failed: {type(err).__name__}: {err}") from err
    return module
