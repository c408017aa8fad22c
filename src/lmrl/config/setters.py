"""Which keys set each key of ours while a config loads, so that two that disagree are one
error naming both instead of a silent last-wins (used by ``lmrl.config.loader``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Setters"]


class Setters:
    """The keys that set each of our paths, to refuse two of them that disagree.

    Several keys may land on one path: verl's spelling of it and ours (``actor_rollout_ref.
    actor.clip_ratio``, ``actor.clip_ratio``), and the verl keys lmrl folds into one (the
    actor's, the reference's and the critic's ``fsdp_config.mixed_precision.param_dtype`` all
    set ``model.mixed_precision.param_dtype``). Two keys that set a path to different values
    are one error naming both, where one would otherwise silently win, with two exceptions,
    where the later one wins as overrides do:

    - the same key twice on the command line, or a path and its one verl spelling
      (``model.path``, ``actor_rollout_ref.model.path``) on the command line or across layers:
      two spellings of one key (in one file, two spellings are still an error);
    - our own path after a file's keys (``model.mixed_precision.param_dtype=fp32`` on the
      command line): it sets the path for every key folded into it.

    A null never disagrees: verl's YAML writes null for the spelling it leaves unset, and a
    null from another key than the one that set a value is ignored (``ignores``). A verl
    switch folded into a key of ours with the others (``Translation.update``, the offload
    flags) combines with them instead and is not tracked.

    Args:
        spellings: ``spellings(path) -> [verl keys]`` of the config kind (the verl keys that
            translate onto ``path``).
    """

    def __init__(self, spellings: Callable[[str], list[str]]) -> None:
        self.spellings = spellings
        self.by_path: dict[str, dict[str, tuple[Any, Any, int]]] = {}

    def conflict(self, path: str, entry: Any, value: Any, layer: int) -> str | None:
        """The error when ``entry`` (of layer number ``layer``; its ``key`` as given, its
        ``raw`` text, None from a file, and its ``source``, "on the command line" or "in
        FILE") sets ``path`` to ``value`` while another key set it to another value; else
        None, and ``entry`` is recorded."""
        setters = self.by_path.setdefault(path, {})
        if entry.key == path and any(number < layer for _, _, number in setters.values()):
            setters.clear()  # our own key, after a file: it sets the path for all of them
        for key, (other, theirs, number) in setters.items():
            if theirs == value or theirs is None or value is None:
                continue  # null: verl's YAML writes it for a key it leaves unset
            if self._one_key(path, key, entry.key) and (entry.raw is not None or number < layer):
                continue
            if other.source == entry.source:
                where = f" ({entry.source}): {other.key}={theirs!r} and {entry.key}={value!r}"
            else:
                where = (f": {other.key}={theirs!r} ({other.source}) and "
                         f"{entry.key}={value!r} ({entry.source})")  # fmt: skip
            fix = "keep one" if self._one_key(path, key, entry.key) else (
                f"lmrl has one {path} for both: give them one value, or set {path} alone")  # fmt: skip
            return f"{path} is set twice{where}; {fix}"
        setters.pop(entry.key, None)
        setters[entry.key] = (entry, value, layer)
        return None

    def ignores(self, path: str, entry: Any, value: Any) -> bool:
        """Whether ``entry`` sets ``path`` to null while another key of verl's set it to a
        value: verl's YAML writes null for the spelling it leaves unset
        (``ppo_micro_batch_size: null`` beside ``ppo_micro_batch_size_per_gpu: 4``), so the
        value stands. Our own path set to null is never ignored."""
        if value is not None or entry.key == path:
            return False
        setters = self.by_path.get(path, {})
        return any(k != entry.key and v is not None for k, (_, v, _) in setters.items())

    def _one_key(self, path: str, a: str, b: str) -> bool:
        """``a`` and ``b`` are spellings of one key: the same, or ``path`` and its only verl
        spelling."""
        if a == b:
            return True
        spellings = self.spellings(path)
        return len(spellings) == 1 and {a, b} == {path, spellings[0]}
