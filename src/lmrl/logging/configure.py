"""``configure_logging(level)``: lmrl's log records on stderr, and no one else's raised.

The commands of ``lmrl`` call it instead of ``logging.basicConfig(level=INFO)``, which sets
the root logger's level and so lets every library's INFO records through (torch's
``FakeTensor cache stats`` at exit, for one). Here only the ``lmrl`` logger gets a level and
a handler; the root logger keeps its level (WARNING unless someone changed it), so other
libraries still show their warnings and errors, through Python's last-resort handler.

Where logging is already configured (the root logger has handlers: an application's own
setup, or pytest's capture), lmrl's records go to those handlers and no second one is added.
Calling it again changes the level and adds nothing.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record (tests and notebooks swap it), as
    Python's own last-resort handler does."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        self.setFormatter(logging.Formatter(FORMAT))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def configure_logging(level: int | str = logging.INFO) -> logging.Logger:
    """Give the ``lmrl`` logger ``level`` and, unless logging is configured already, a stderr
    handler; the root logger and other libraries' loggers are left as they are.

    Args:
        level: the lowest level of lmrl's records to show (``logging.INFO``, ``"WARNING"``).

    Returns:
        The ``lmrl`` logger.
    """
    logger = logging.getLogger("lmrl")
    logger.setLevel(level)
    has_ours = any(isinstance(h, _StderrHandler) for h in logger.handlers)
    if not has_ours and not logging.getLogger().handlers:
        logger.addHandler(_StderrHandler())
    return logger
