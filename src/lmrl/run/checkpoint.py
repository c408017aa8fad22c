"""Checkpoints that a run killed at any moment resumes from, exactly.

A checkpoint is a directory ``global_step_<N>`` in the run directory holding everything that
changes during training: model weights as safetensors (``actor.safetensors``,
``critic.safetensors``), and ``state.pt`` with the optimizers, schedulers, shuffling RNGs, KL
controller, data sampler position, the global RNG states and the step counter. Nothing is
loaded with plain pickle: ``state.pt`` is read with ``torch.load(weights_only=True)``.

Writes are atomic: everything goes into ``.global_step_<N>.tmp``, each file is fsynced, a
``manifest.json`` with every file's size and SHA-256 is written last, and only then is the
directory renamed into place. A checkpoint without a manifest, or whose files do not match
it, is corrupt: ``latest_checkpoint`` skips it (with a warning) for the previous good one.
The manifest also names the command whose run wrote it (``"command": "lmrl sft"``), so a run
directory is never resumed by another command (``lmrl.run.resume``).

A checkpoint saved again at its step (the run doctor re-saves the best one after a rollback)
is replaced in two renames: the old one aside to ``.global_step_<N>.old``, the new one into
place; `finish_replace` puts back whichever of the two is complete when a kill fell between
them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lmrl.errors import CheckpointError

log = logging.getLogger("lmrl.trainer")

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


# ---------------------------------------------------------------------- RNG state


def rng_state() -> dict[str, Any]:
    """The global RNG states (python, numpy, torch CPU and CUDA) as tensors and plain data."""
    # numpy's stub types a bare get_state() as the dict form; legacy=True is its default
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # the legacy form: the global generator is an MT19937
    state = {
        "python": _to_plain(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_to_tuple(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_plain(x):
    return [_to_plain(v) for v in x] if isinstance(x, tuple | list) else x


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list) else x


# -------------------------------------------------------------------------- files


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file or a directory (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's ``<name>.safetensors`` (CPU)."""
    try:
        return load_file(path)
    except (OSError, ValueError) as err:  # missing, or not a safetensors file
        raise CheckpointError(f"{path}: cannot read the weights: {err}") from None


def load_model_state(model: torch.nn.Module, path: Path) -> None:
    """Load weights saved by `model_state` (strict: every saved tensor must land).

    Raises:
        CheckpointError: unreadable weights, or weights of another model (a tensor of another
            shape, one the model lacks, one the checkpoint lacks), in one line.
    """
    from lmrl.models.loading import refuse_other_shapes  # transformers: imported when used

    state = read_weights(path)
    try:
        refuse_other_shapes(model, state)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None
    current = model.state_dict()
    saved_ptrs = {current[n].data_ptr() for n in state if n in current}
    tied = {n for n, t in current.items() if n not in state and t.data_ptr() in saved_ptrs}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise CheckpointError(f"{path}: tensors the model does not have: {unexpected[:5]}")
    if set(missing) - tied:
        raise CheckpointError(f"{path}: the checkpoint lacks {sorted(set(missing) - tied)[:5]}")


def save_checkpoint(
    run_dir: Path,
    step: int,
    weights: dict[str, dict[str, torch.Tensor]],
    state: dict[str, Any],
    max_to_keep: int | None = None,
    before_manifest=None,
    command: str | None = None,
    keep: Path | None = None,
    note: dict[str, Any] | None = None,
) -> Path:
    """Write ``run_dir/global_step_<step>`` atomically; prune old ones beyond ``max_to_keep``.

    Args:
        weights: name -> full weights (``model_state``); each saved as ``<name>.safetensors``.
        state: tensors and plain Python data (no arbitrary objects), saved as ``state.pt``.
        max_to_keep: keep only the newest this many checkpoints (None = all).
        before_manifest: called once the data files are written, before the manifest (a
            testing hook: a crash there must leave no usable checkpoint behind).
        command: the command of the run (``lmrl train``...), written into the manifest.
        keep: a checkpoint pruning spares (the run doctor's best validated one).
        note: plain data written into the manifest beside ``step`` (`manifest_field` reads
            it back): the run doctor marks the best checkpoint it re-saves in a rollback.
    """
    run_dir = Path(run_dir)
    final = run_dir / f"global_step_{step}"
    tmp = run_dir / f".global_step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, tensors in weights.items():
        save_file(tensors, tmp / f"{name}.safetensors")
    torch.save(state, tmp / "state.pt")
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    for p in files:
        fsync_path(p)
    if before_manifest is not None:
        before_manifest()
    manifest: dict[str, Any] = {"step": step}
    if command is not None:
        manifest["command"] = command
    manifest |= note or {}
    manifest["files"] = {p.name: [p.stat().st_size, _sha256(p)] for p in files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    fsync_path(tmp / MANIFEST)
    old = run_dir / f".global_step_{step}.old"
    if final.exists():  # saved again at its step: the old one aside first (`finish_replace`)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    if max_to_keep:
        for old in list_checkpoints(run_dir)[:-max_to_keep]:
            if keep is None or old.resolve() != Path(keep).resolve():
                shutil.rmtree(old, ignore_errors=True)
    return final


def finish_replace(run_dir: Path, step: int) -> None:
    """Finish replacing ``global_step_<step>`` when a kill fell between `save_checkpoint`'s two
    renames (the old one aside, the new one in): the new one goes into place if it is complete,
    else the old one goes back; a leftover old one is removed."""
    run_dir = Path(run_dir)
    final = run_dir / f"global_step_{step}"
    tmp, old = run_dir / f".global_step_{step}.tmp", run_dir / f".global_step_{step}.old"
    if not old.is_dir():
        return
    if not final.exists():
        os.replace(tmp if tmp.is_dir() and check_checkpoint(tmp) is None else old, final)
        fsync_path(run_dir)
    shutil.rmtree(old, ignore_errors=True)


def checkpoint_step(path: Path) -> int:
    """The step of a ``global_step_<N>`` directory.

    Raises:
        ValueError: ``path`` is not named ``global_step_<N>``.
    """
    m = _STEP_DIR.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a global_step_<N> directory")
    return int(m.group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """``global_step_<N>`` directories of ``run_dir``, oldest first (validity not checked)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, its ``files`` checked to be ``{name: [size, sha256]}``.

    Raises:
        OSError, ValueError, KeyError, TypeError: unreadable, not JSON, or another layout.
    """
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
        isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str)
        for v in files.values()
    ):
        raise TypeError("'files' is not {name: [size, sha256]}")
    return manifest


def check_checkpoint(path: Path) -> str | None:
    """None if ``path`` is a complete checkpoint, else what is wrong with it (one line)."""
    if not (Path(path) / MANIFEST).is_file():
        return "no manifest (an interrupted save)"
    try:
        files = _read_manifest(path)["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        why = f"no {err}" if isinstance(err, KeyError) else _first_line(err)
        return f"unreadable {MANIFEST} ({why})"
    for name, (size, digest) in files.items():
        p = Path(path) / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size or _sha256(p) != digest:
            return f"{name} does not match its manifest (truncated or corrupt)"
    return None


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def manifest_field(path: Path, key: str) -> Any:
    """The manifest's ``key`` of checkpoint ``path`` (``command``, or a `save_checkpoint`
    note), or None: absent, or the manifest is unreadable."""
    try:
        return _read_manifest(path).get(key)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_command(path: Path) -> str | None:
    """The command whose run wrote checkpoint ``path`` (its manifest's ``command``), or None:
    unreadable, or written before manifests named it."""
    command = manifest_field(path, "command")
    return command if isinstance(command, str) else None


def scan_checkpoints(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint of ``run_dir`` (None if none), and ``(path, problem)``
    of each newer one that is not complete (all of them when none is), newest first."""
    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(run_dir)):
        problem = check_checkpoint(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint in ``run_dir``; corrupt ones are skipped with a warning."""
    found, skipped = scan_checkpoints(run_dir)
    for path, problem in skipped:
        log.warning("skipping checkpoint %s: %s", path, problem)
    return found


def load_state(path: Path) -> dict[str, Any]:
    """``state.pt`` of a checkpoint, loaded with ``weights_only=True``."""
    return torch.load(Path(path) / "state.pt", weights_only=True, map_location="cpu")
