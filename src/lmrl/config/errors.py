"""The one exception of the config package.

``ConfigError`` is an ``lmrl.errors.LmrlError`` (the CLI prints it without a traceback). It carries every
problem found in one pass, so a user fixes a command line once, not once per key.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmrl.errors import LmrlError


class ConfigError(LmrlError):
    """One or more configuration problems, each naming the key and the fix.

    Attributes:
        errors: the individual messages, in the order they were found.
    """

    def __init__(self, errors: str | Sequence[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        if len(self.errors) == 1:
            message = self.errors[0]
        else:
            lines = "\n".join(f"  - {e}" for e in self.errors)
            message = f"{len(self.errors)} config errors:\n{lines}"
        super().__init__(message)
