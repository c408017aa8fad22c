"""lmrl's own error types: the faults a user can fix by changing an input.

The command line prints these as one line (``lmrl <command>: error: ...``) and exits 2;
anything else is a bug and keeps its traceback (exit 1). Each is also a ``ValueError`` so
that code catching the builtin keeps working. Raise the most specific one, where the bad
input is read, with a message that names the file, row, column or key.
"""

from __future__ import annotations


class LmrlError(ValueError):
    """Base of every error the user can fix by changing an input."""


class DataError(LmrlError):
    """A data file that is missing, unreadable or malformed (names the file, row, column)."""


class ModelError(LmrlError):
    """A model or tokenizer that cannot be loaded from its path (names the path or file)."""


class RewardError(LmrlError):
    """A reward function that cannot be loaded, or that fails on (nearly) every sample."""


class CheckpointError(LmrlError):
    """A run directory or checkpoint that cannot be read, written or resumed from."""


class WorkerError(LmrlError):
    """A worker process of a distributed run died or failed (names the worker and its host)."""


__all__ = ["CheckpointError", "DataError", "LmrlError", "ModelError", "RewardError", "WorkerError"]


class ToolLoadError(LmrlError):
    """A tool that cannot be made: an unknown name, a tool file that is missing or fails to
    import, a retriever corpus that cannot be read, a retrieval server that fails its start-up
    query (names the tool and the file or URL)."""


class ToolRunError(LmrlError):
    """A tool that fails (errs at its own fault or times out) on nearly every call of the
    first batch that calls it (names the tool, the fraction and the first error)."""


class DivergedError(LmrlError):
    """A policy whose weights have diverged: its logits are not finite (NaN/inf) where it
    samples (names the likely cause and the key to change, e.g. ``actor.optim.lr``)."""
