"""Where a run starts: its directory, the checkpoint it resumes from, and what changed since.

Decided before any model loads, so a bad directory or a refused resume costs one line and no
wait. The rules:

- The run directory must be creatable and writable; the check leaves nothing behind.
- A run directory has one owner at a time (``lmrl.run.lock``): a directory another process
  is running in is refused, naming its pid and command; so is a sweep's folder (it holds
  ``sweep.json``). The loop holds the lock for the run's life, and refuses to start a run
  whose directory gained a checkpoint after `open_run` looked (`check_untouched`).
- A run directory belongs to the command that made it (`run_owner`: the command named in the
  first line of its ``config.yaml``, which ``save_config`` writes, else in its checkpoints'
  manifests): ``lmrl sft`` never writes into a directory of ``lmrl train`` and the reverse,
  and a checkpoint of another command is never resumed. A directory that names no command
  (a new one, or one written before they did) is accepted.
- ``trainer.resume_mode``: ``auto`` (the newest complete checkpoint of the run directory, if
  any), ``disable`` (start fresh), or a checkpoint path (it must exist and be complete). With
  ``auto``, a directory whose checkpoints all fail their manifest check (and hold files) is
  refused rather than trained over from scratch; ``disable`` starts over in it.
- Resuming with settings that differ from the run's ``config.yaml`` is refused, naming each
  changed key with its old and new value, unless ``trainer.allow_config_change=true``; then
  the new settings apply in full and the old file is kept as ``config.step<N>.yaml`` once the
  run starts. Keys that steer the run without changing what it computes (its length, how often
  it saves, validates and logs, the workers that score) may change freely.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmrl.config import Config, config_to_dict
from lmrl.config.loader import save_config, yaml_problem
from lmrl.errors import CheckpointError
from lmrl.run.checkpoint import (
    check_checkpoint,
    checkpoint_command,
    list_checkpoints,
    scan_checkpoints,
)
from lmrl.run.lock import RunDirLock, holds_lock, refuse_sweep_folder

log = logging.getLogger("lmrl.trainer")

# keys a resumed run may change without trainer.allow_config_change
FREE_TO_CHANGE = (
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.resume_mode",
    "trainer.max_ckpt_to_keep",
    "trainer.logger",
    "trainer.log_generations_freq",
    "trainer.memory_probe",  # changes nothing: the probe restores all it moves
    "trainer.allow_config_change",
    "trainer.project_name",
    "trainer.default_local_dir",
    "trainer.device",
    "trainer.experiment_name",
    "reward.num_workers",
    "reward.timeout_s",
    "reward.max_error_fraction",
    "rollout.multi_turn.max_tool_error_fraction",
    "data.val_files",
    "data.val_batch_size",
    "rollout.val_kwargs.",
    # where the workers run: the update and the sampling are the same for any placement
    "trainer.backend",
    "resources.",
    "actor.strategy",
    "actor.offload",
    "critic.strategy",
    "critic.offload",
)


def check_run_dir(path: Path) -> None:
    """Raise ``CheckpointError`` (one line) unless ``path`` can be created and written to.

    Probes by creating the missing directories and a temporary file, then removes what it
    made: a launch that fails later leaves no empty run directory behind.
    """
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    if not probe.is_dir():
        raise CheckpointError(
            f"trainer.default_local_dir={path}: {probe} is a file, not a directory"
        )
    try:
        for d in reversed(missing):
            d.mkdir()
        with tempfile.NamedTemporaryFile(dir=path, prefix=".lmrl-write-test"):
            pass
    except OSError as err:
        raise CheckpointError(
            f"trainer.default_local_dir={path} is not writable: {err.strerror or err}"
        ) from None
    finally:
        for d in missing:
            with contextlib.suppress(OSError):
                d.rmdir()


# the first line of a config.yaml that save_config wrote names the command of its run
_HEADER = re.compile(r"# lmrl resolved config: load it with `(lmrl [\w-]+) --config")


def run_owner(run_dir: Path) -> str | None:
    """The command that made ``run_dir`` (``lmrl train``, ``lmrl sft``, ``lmrl train-flow``).

    Returns:
        The command the first line of ``config.yaml`` names, else the one the newest
        checkpoint's manifest names; None when neither names one.
    """
    try:
        with (Path(run_dir) / "config.yaml").open(encoding="utf-8", errors="replace") as f:
            header = _HEADER.match(f.readline())
    except OSError:
        header = None
    if header:
        return header.group(1)
    for path in reversed(list_checkpoints(run_dir)):
        if (command := checkpoint_command(path)) is not None:
            return command
    return None


def _from_sft_hint(owner: str, command: str, run_dir: Path) -> str:
    """How to start RL from an SFT run, when that is what a user may have meant."""
    final = run_dir / "final"
    if owner == "lmrl sft" and command == "lmrl train" and final.is_dir():
        return f" (to start from its model: model.path={final})"
    return ""


def check_owner(run_dir: Path, command: str) -> None:
    """Refuse to run ``command`` in a run directory another command made (`run_owner`).

    Raises:
        CheckpointError: one line naming both commands.
    """
    owner = run_owner(run_dir)
    if owner is not None and owner != command:
        raise CheckpointError(
            f"{run_dir} was made by `{owner}`; `{command}` will not write into it: give "
            f"another trainer.default_local_dir{_from_sft_hint(owner, command, run_dir)}"
        )


def unloadable(skipped: list[tuple[Path, str]]) -> str:
    """``"global_step_2: unreadable manifest.json (...); ..."``: at most three, one line."""
    listing = "; ".join(f"{path.name}: {problem}" for path, problem in skipped[:3])
    return listing + (f"; {len(skipped) - 3} more" if len(skipped) > 3 else "")


def _holds_files(path: Path) -> bool:
    return path.is_file() or any(p.is_file() for p in path.rglob("*"))


def resume_point(mode: str, run_dir: Path, command: str) -> Path | None:
    """The checkpoint ``trainer.resume_mode`` names, or None to start fresh.

    Args:
        mode: ``auto``, ``disable`` or a checkpoint path.
        run_dir: the run directory.
        command: the command that resumes (a checkpoint of another command is refused).
    Raises:
        CheckpointError: a path that does not exist, is not a complete checkpoint or belongs
            to another command; with ``auto``, checkpoints that hold files and none of which
            is complete (starting over would replace them).
    """
    if mode == "disable":
        return None
    if mode == "auto":
        found, skipped = scan_checkpoints(run_dir)
        if found is None and any(_holds_files(path) for path, _ in skipped):
            raise CheckpointError(
                f"{run_dir}: none of its checkpoints can be resumed from ({unloadable(skipped)});"
                " nothing was changed: repair them, give another trainer.default_local_dir, or "
                "set trainer.resume_mode=disable to start over (its checkpoints replace these)"
            )
        for where, why in skipped:
            log.warning("skipping checkpoint %s: %s", where, why)
        return found
    path = Path(mode)
    if not path.exists():
        raise CheckpointError(
            f"trainer.resume_mode={mode}: does not exist (resume_mode takes auto, disable, or "
            "a checkpoint directory global_step_N of a run)"
        )
    problem = check_checkpoint(path)
    if problem:
        raise CheckpointError(f"trainer.resume_mode={mode}: not a usable checkpoint: {problem}")
    owner = checkpoint_command(path) or run_owner(path.parent)
    if owner is not None and owner != command:
        raise CheckpointError(
            f"trainer.resume_mode={mode} is a checkpoint of `{owner}`; `{command}` cannot resume "
            f"from it{_from_sft_hint(owner, command, path.parent)}"
        )
    return path


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out |= _leaves(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: tree}


def config_changes(saved: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """``(key, old, new)`` for every setting that differs, except the free-to-change ones."""
    old_leaves, new_leaves = _leaves(saved), _leaves(new)
    changes = []
    for key in sorted(old_leaves.keys() | new_leaves.keys()):
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE_TO_CHANGE):
            continue
        old, value = old_leaves.get(key), new_leaves.get(key)
        if old != value:
            changes.append((key, old, value))
    return changes


def check_config_change(cfg: Config, checkpoint: Path) -> list[tuple[str, Any, Any]]:
    """Compare ``cfg`` with the ``config.yaml`` beside ``checkpoint``.

    Returns:
        The changes (empty when none, or when there is no saved config to compare with).
    Raises:
        CheckpointError: settings changed and ``trainer.allow_config_change`` is false.
    """
    saved_path = Path(checkpoint).parent / "config.yaml"
    if not saved_path.is_file():
        return []
    try:
        saved = yaml.safe_load(saved_path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        why = yaml_problem(err) if isinstance(err, yaml.YAMLError) else str(err)
        raise CheckpointError(
            f"{saved_path}: unreadable ({why}); it holds the settings this run was saved with: "
            "restore it, or delete it to resume without comparing them"
        ) from None
    new = yaml.safe_load(yaml.safe_dump(config_to_dict(cfg)))  # as config.yaml holds it
    changes = config_changes(saved, new)
    if changes and not cfg.trainer.allow_config_change:
        lines = "\n".join(f"  {key}: {old!r} -> {new!r}" for key, old, new in changes)
        raise CheckpointError(
            f"resuming {checkpoint} with settings that differ from {saved_path}:\n{lines}\n"
            "Resume with the saved settings, start a new run (trainer.resume_mode=disable or "
            "another trainer.default_local_dir), or set trainer.allow_config_change=true to "
            "apply the new settings."
        )
    return changes


def keep_old_config(run_dir: Path, step: int) -> Path | None:
    """Rename ``config.yaml`` to ``config.step<step>.yaml`` (numbered further if taken)."""
    current = Path(run_dir) / "config.yaml"
    if not current.is_file():
        return None
    target = current.with_name(f"config.step{step}.yaml")
    n = 1
    while target.exists():
        n += 1
        target = current.with_name(f"config.step{step}.{n}.yaml")
    os.replace(current, target)
    return target


__all__ = [
    "FREE_TO_CHANGE",
    "RunStart",
    "check_config_change",
    "check_owner",
    "check_run_dir",
    "check_untouched",
    "config_changes",
    "keep_old_config",
    "open_run",
    "resume_point",
    "run_owner",
    "unloadable",
]


@dataclass(frozen=True)
class RunStart:
    """Where a run starts, decided before any model loads (`open_run`).

    Attributes:
        run_dir: ``trainer.default_local_dir``.
        command: the command the run belongs to (``lmrl train``, ``lmrl sft``...), written
            into ``config.yaml``'s first line and each checkpoint's manifest (`run_owner`).
        config: the resolved config (written as ``config.yaml`` once the run really starts).
        resume_from: the checkpoint to resume from, or None for a fresh start.
        config_changes: ``(key, old, new)`` accepted with ``trainer.allow_config_change``.
    """

    run_dir: Path
    command: str
    config: Any
    resume_from: Path | None = None
    config_changes: list[tuple[str, Any, Any]] = field(default_factory=list)

    @property
    def start_step(self) -> int:
        """The step the run resumes at (the checkpoint's ``global_step_<N>``), 0 when fresh."""
        return int(self.resume_from.name.rsplit("_", 1)[1]) if self.resume_from else 0

    def begin(self, step: int) -> None:
        """The run really starts: write ``config.yaml``, keeping a changed one's old file as
        ``config.step<step>.yaml`` and naming each change."""
        if self.config_changes:
            kept = keep_old_config(self.run_dir, step)
            for key, old, new in self.config_changes:
                log.warning("resumed with %s changed: %r -> %r", key, old, new)
            log.warning("the previous settings are kept in %s", kept)
        save_config(self.config, self.run_dir / "config.yaml", command=self.command)


def open_run(cfg: Any, command: str) -> RunStart:
    """Check ``cfg.trainer.default_local_dir`` and decide the resume point (``resume_mode``)
    and the accepted config changes, before anything is loaded.

    Raises:
        CheckpointError: an unwritable directory, a directory another process is running in
            (`lmrl.run.lock`), a sweep's folder, a directory or checkpoint of another command,
            a resume path that is not a checkpoint, checkpoints none of which loads, or changed
            settings without ``trainer.allow_config_change``.
    """
    t = cfg.trainer
    run_dir = Path(t.default_local_dir)
    check_run_dir(run_dir)
    refuse_sweep_folder(run_dir, command)
    if not holds_lock(run_dir):  # refused now, before any model loads, if another runs in it
        RunDirLock(run_dir).acquire().release()
    check_owner(run_dir, command)
    resume_from = resume_point(t.resume_mode, run_dir, command)
    changes = check_config_change(cfg, resume_from) if resume_from is not None else []
    _opened[run_dir.resolve()] = _newest(run_dir)
    return RunStart(run_dir, command, cfg, resume_from, changes)


# run directory -> the name of its newest checkpoint when `open_run` looked (None: none)
_opened: dict[Path, str | None] = {}


def _newest(run_dir: Path) -> str | None:
    found = list_checkpoints(run_dir)
    return found[-1].name if found else None


def check_untouched(run_dir: Path) -> None:
    """Refuse to start a run whose directory gained or lost a checkpoint since `open_run`
    decided where it starts: another process wrote into it meanwhile (one that started while
    this run loaded its models, and ended before the loop took the directory's lock), so that
    start is stale. Called by the loop under the lock; a directory `open_run` did not look at
    (or one already checked) passes.

    Raises:
        CheckpointError: one line naming the checkpoints then and now.
    """
    key = Path(run_dir).resolve()
    if key not in _opened:
        return
    seen, now = _opened.pop(key), _newest(run_dir)
    if now != seen:
        raise CheckpointError(
            f"{run_dir} changed while this run was being set up (its newest checkpoint was "
            f"{seen or 'none'}, is now {now or 'none'}): another command wrote into it; "
            "nothing was written: run the command again to start from what is there now"
        )
