"""The parity probe: when the engine's log-probs part from the trainer's, say why, once.

Every step that recomputes old log-probs logs the engine's gap (`engine_gap`). The first time
its mean ``|old - rollout|`` over response tokens exceeds ``trainer.parity_threshold``,
`ParityProbe` runs one diagnosis on that step's batch and names the usual cause, cheapest
conclusive probe first:

    1 tokenization  no forward: the responses that do not survive decode -> encode carry the
                    gap while the others are clean (the trainer scores other ids than sampled)
    2 stale_weights two forwards of the engine's model, around a forced weight sync: the sync
                    removes at least half of the gap (skipped when the engine generates with
                    the actor's own module, or cannot score given tokens, as vLLM here)
    3 dtype         the engine (or the trainer's autocast) computes below fp32, and its
                    log-probs of the same tokens move from the fp32 recompute by at least half
                    the gap (reuses probe 2's scores; one fp32 pass of the actor when mixed)
    4 micro_batch   the actor's log-probs recomputed with 1 row per micro-batch (no padding),
                    with all rows in one, and with all rows in one with no prompt shared or
                    packed (every row its own sequence, as the engine's decode has them), move
                    by at least half the gap: the model's output depends on the batch shape or
                    its padding

and ``unknown``, with every figure, when none does. The message is one line, logged as a
warning (as the health warnings are) and the figures are metrics at that step (``parity/``).

The choice made here: the trigger is the mean absolute log-prob difference, not k3. It is in
nats per token and linear in the difference, so a threshold reads directly ("the engine is
off by 0.05 nats a token") and the probes' figures compare with it in the same unit, while
k3 ~ d^2/2 hides small per-token errors and spikes on a few. Each probe is judged against the
gap itself (it must explain half of it), so one threshold serves every model size.

Under ``trainer.backend=ray`` the actor and the engine live in worker processes: only the
tokenization probe (the driver's tokenizer) runs, and the message says so.

"Once per run" holds across a resume: whether the probe ran is part of the trainer's
checkpoint state (`ParityProbe.state_dict`), so a resumed run that had probed does not probe
again, and one stopped before its probe probes when the gap first exceeds the threshold. A
checkpoint written before the state held it loads as not probed. A rollback (the run doctor)
returns it to the best checkpoint's, with the rest of the state.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmrl.algos.masked import masked_mean
from lmrl.batch import Batch, response_tokens_mask
from lmrl.models import compute_log_probs
from lmrl.rollout.base import EngineView
from lmrl.workers.actor import ActorWorker

if TYPE_CHECKING:
    from lmrl.workers.roles import EngineRole

log = logging.getLogger("lmrl.trainer")

__all__ = ["CAUSES", "GAP_KEY", "LABELS", "Diagnosis", "ParityProbe", "diagnose"]

GAP_KEY = "rollout/actor_logprob_abs_diff"
CAUSES = ("unknown", "stale_weights", "tokenization", "micro_batch", "dtype")
"""``parity/cause`` is the index of the cause here."""
LABELS = {"unknown": "unknown", "stale_weights": "stale weights", "tokenization": "tokenization",
          "micro_batch": "padding or micro-batch shape", "dtype": "dtype"}  # fmt: skip
EXPLAINS = 0.5  # a probe names its cause when it accounts for this share of the gap


@dataclass
class Diagnosis:
    """The probe's verdict: ``cause`` (one of `CAUSES`), a one-line ``message``, the
    ``figures`` behind it (``parity/...`` floats)."""

    cause: str
    message: str
    figures: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {"parity/cause": float(CAUSES.index(self.cause)), **self.figures}


def _mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |a - b| over ``mask`` (B, T), as a float (reporting code: one sync)."""
    return float(masked_mean((a.float() - b.float()).abs(), mask))


def round_trips(tokenizer, responses: torch.Tensor, tokens_mask: torch.Tensor) -> torch.Tensor:
    """Which responses survive decode -> encode unchanged.

    Args:
        responses: (B, T) token ids; tokens_mask: (B, T) bool, the real response tokens.
    Returns:
        (B,) bool.
    """
    rows = [ids[m].tolist() for ids, m in zip(responses, tokens_mask.bool(), strict=True)]
    texts = tokenizer.batch_decode(
        rows, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    again = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return torch.tensor([list(a) == r for a, r in zip(again, rows, strict=True)])


class _Run:
    """One diagnosis: the batch, its gap, and the scores the probes share."""

    def __init__(
        self, batch: Batch, threshold: float, tokenizer, actor, view: EngineView | None
    ) -> None:
        self.batch, self.threshold, self.tokenizer = batch, threshold, tokenizer
        self.actor, self.view = actor, view
        self.old, self.rollout = batch["old_log_probs"], batch["rollout_log_probs"]
        self.mask = batch["response_mask"].bool()
        self.gap = _mean_abs(self.old, self.rollout, self.mask)
        self.figures: dict[str, float] = {"parity/gap": self.gap}
        self.skipped: list[str] = []
        self.engine_scores: torch.Tensor | None = None  # the engine's, after the forced sync

    def explains(self, share: float) -> bool:
        return share >= EXPLAINS * self.gap

    def actor_scores(self, micro: int, fp32: bool = False, share: bool = True) -> torch.Tensor:
        """(B, T) the actor's log-probs of the batch with ``micro`` rows per forward, in its
        compute dtype (or with autocast off when ``fp32``), each row its own sequence unless
        ``share`` (prompts shared or packed, as the trainer scores)."""
        a = self.actor
        context = contextlib.nullcontext() if fp32 else a.autocast()
        with a.dp.full_params(a.model), context:
            return compute_log_probs(a.model, self.batch, micro, a.temperature,
                                     share_prompts=share)[0]  # fmt: skip

    @property
    def micro(self) -> int:
        return self.actor.log_prob_micro_batch_size or len(self.batch)

    # ------------------------------------------------------------------ probes
    def tokenization(self) -> Diagnosis | None:
        if self.tokenizer is None:
            self.skipped.append("tokenization (no tokenizer)")
            return None
        ok = round_trips(self.tokenizer, self.batch["responses"], response_tokens_mask(self.batch))
        bad = ~ok
        self.figures["parity/tokenization_bad_frac"] = float(bad.float().mean())
        if not ok.any() or not bad.any():  # nothing to contrast: not conclusive
            return None
        clean = _mean_abs(self.old, self.rollout, self.mask & ok[:, None])
        dirty = _mean_abs(self.old, self.rollout, self.mask & bad[:, None])
        self.figures["parity/tokenization_gap_clean"] = clean
        if clean > min(self.threshold, 0.25 * dirty):
            return None
        return Diagnosis(
            "tokenization",
            f"{int(bad.sum())} of {len(bad)} responses do not survive decode -> encode and "
            f"they carry the gap ({dirty:.4g} there, {clean:.4g} in the others): the trainer "
            "scores other token ids than the engine sampled; keep the engine's ids end to end "
            "(never re-encode decoded text) and check both sides use the same tokenizer",
        )

    def stale_weights(self) -> Diagnosis | None:
        view = self.view
        if view is None or view.model is None:
            self.skipped.append("stale weights and the engine's dtype (it cannot score tokens)")
            return None
        if view.shares_weights:  # the engine's module is the actor's: nothing to sync
            return None
        model = view.model
        # an engine with its own copy of the weights syncs it (`lmrl.rollout.copy.CopyEngine`)
        assert view.sync is not None
        before = _mean_abs(self._engine_scores(view, model), self.old, self.mask)
        view.sync()
        self.engine_scores = self._engine_scores(view, model)
        after = _mean_abs(self.engine_scores, self.old, self.mask)
        self.figures |= {"parity/stale_gap_before_sync": before,
                         "parity/stale_gap_after_sync": after}  # fmt: skip
        if not self.explains(before - after):
            return None
        return Diagnosis(
            "stale_weights",
            f"a forced weight sync took the engine's gap to the trainer on the same tokens "
            f"from {before:.4g} to {after:.4g}: the engine generated with stale weights; check "
            "that each update reaches it (RolloutEngine.sync_weights; weights changed outside "
            "the optimizer must call lmrl.models.loading.bump_weights_version)",
        )

    def _engine_scores(self, view: EngineView, model: nn.Module) -> torch.Tensor:
        """(B, T) the engine's ``model`` (``view.model``)'s log-probs of the batch."""
        with view.autocast():
            return compute_log_probs(model, self.batch, self.micro, self.actor.temperature)[0]

    def dtype(self) -> Diagnosis | None:
        a, view = self.actor, self.view
        if a.precision.master.itemsize < 4:
            self.skipped.append(f"dtype (the actor's weights are {a.precision.master})")
            return None
        engine_compute = view.compute if view is not None else None
        engine_low = engine_compute is not None and engine_compute.itemsize < 4
        engine_shares = view is not None and view.shares_weights
        if not (a.precision.mixed or engine_low):
            return None  # everything computes in fp32: not the cause
        fp32 = self.actor_scores(self.micro, fp32=True) if a.precision.mixed else self.old
        shifts = {"the trainer": _mean_abs(self.old, fp32, self.mask)}
        if engine_low and engine_shares:  # the actor's module under its autocast
            shifts["the engine"] = shifts["the trainer"]
        elif engine_low:  # its model scored the tokens after the forced sync (probe 2)
            # an engine below fp32 with weights of its own has a model (CopyEngine): probe 2
            # scored with it, or named the cause and this probe does not run
            assert self.engine_scores is not None
            shifts["the engine"] = _mean_abs(self.engine_scores, fp32, self.mask)
        side, shift = max(shifts.items(), key=lambda kv: kv[1])
        self.figures["parity/dtype_shift"] = shift
        if not self.explains(shift):
            return None
        engine = side == "the engine"
        dtype = str(engine_compute if engine else a.precision.compute).removeprefix("torch.")
        fix = "rollout.dtype=float32" if engine else "model.mixed_precision.param_dtype=float32"
        return Diagnosis(
            "dtype",
            f"{side} computes in {dtype} and the fp32 recompute moves its log-probs of the same "
            f"tokens by {shift:.4g}: the gap is precision, expected in {dtype}; correct for it "
            f"(rollout.log_prob_mode=rollout_correction) or compute in float32 ({fix})",
        )

    def micro_batch(self) -> Diagnosis | None:
        rows = len(self.batch)
        scores = [self.actor_scores(m) for m in {1, rows} - {self.micro}]
        scores.append(self.actor_scores(rows, share=False))
        shift = max(_mean_abs(score, self.old, self.mask) for score in scores)
        self.figures["parity/micro_batch_shift"] = shift
        if not self.explains(shift):
            return None
        return Diagnosis(
            "micro_batch",
            f"recomputing the actor's log-probs with another micro-batch (1 row, no padding, "
            f"or all rows, shared prompts or not) moves them by {shift:.4g}: the model's output "
            "depends on the batch "
            "shape or its padding; check position_ids and the attention mask under left "
            "padding, and the attention implementation (batch-variant kernels)",
        )


def diagnose(
    batch: Batch,
    threshold: float,
    tokenizer,
    actor=None,
    engine: EngineRole | None = None,
    note: str | None = None,
) -> Diagnosis:
    """Name the cause of the engine's gap on one step's batch (module docstring).

    Args:
        batch: the step's batch after old log-probs: ``old_log_probs``, ``rollout_log_probs``,
            ``responses``, ``response_mask`` (B, T), ``input_ids``, ``attention_mask``,
            ``position_ids`` (B, P+T).
        threshold: the gap that triggered the probe (mean |old - rollout|, nats per token).
        tokenizer: the policy's tokenizer (None skips the tokenization probe).
        actor: the in-process `ActorWorker`; None runs the tokenization probe only.
        engine: the rollout engine (any wrapper lmrl builds around it).
        note: why only part of the probes ran, appended to the message.
    Returns:
        The `Diagnosis`; its message is one line.
    """
    view = engine.view() if engine is not None else None
    run = _Run(batch, threshold, tokenizer, actor, view)
    probes = [run.tokenization]
    if actor is not None:
        probes += [run.stale_weights, run.dtype, run.micro_batch]
    found = None
    for probe in probes:
        found = probe()
        if found is not None:
            break
    head = (f"parity: the engine's log-probs differ from the trainer's by {run.gap:.4g} nats "
            f"per token (> trainer.parity_threshold={threshold:g})")  # fmt: skip
    if found is None:
        figures = ", ".join(f"{k.removeprefix('parity/')}={v:.4g}" for k, v in run.figures.items())
        found = Diagnosis(
            "unknown",
            f"none of the probes explains it ({figures}); compare the engine's and the "
            "trainer's model config, sampling (temperature, top-p/top-k) and chat template",
        )
    tail = "; skipped: " + ", ".join(run.skipped) if run.skipped else ""
    tail += f"; {note}" if note else ""
    found.message = f"{head}. Cause: {LABELS[found.cause]}: {found.message}{tail}"
    found.figures = run.figures
    return found


class ParityProbe:
    """Watches the engine's gap each step; diagnoses it the first time it exceeds
    ``threshold`` (once per run).

    Args:
        threshold: mean |old - rollout| log-prob over response tokens (nats) that triggers
            the probe; None or <= 0 turns it off.
    """

    def __init__(self, threshold: float | None) -> None:
        self.threshold = threshold if threshold and threshold > 0 else None
        self.done = False

    def state_dict(self) -> dict[str, bool]:
        """Whether the probe ran (``done``): part of the trainer's checkpoint state."""
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, bool] | None) -> None:
        """Restore `state_dict`'s; None (a checkpoint written before it held it) is a run
        that has not probed."""
        self.done = bool(state["done"]) if state is not None else False

    def __call__(self, batch: Batch, gap_metrics: dict, parts) -> dict[str, float]:
        """After `engine_gap`: ``parity/`` metrics at the step the probe runs, else {}.

        Args:
            batch: the step's batch (see `diagnose`).
            gap_metrics: `engine_gap`'s output (``rollout/actor_logprob_abs_diff`` read).
            parts: the run's `RunParts` (actor, engine, tokenizer, backend).
        """
        if self.threshold is None or self.done or GAP_KEY not in gap_metrics:
            return {}
        if not float(gap_metrics[GAP_KEY]) > self.threshold:
            return {}
        self.done = True
        if isinstance(parts.actor, ActorWorker):
            found = diagnose(batch, self.threshold, parts.tokenizer, parts.actor, parts.engine)
        else:
            note = (
                "under trainer.backend=ray only the tokenization probe runs (the actor and the "
                "engine live in worker processes)"
                if parts.backend is not None
                else f"only the tokenization probe runs (the actor is a {type(parts.actor).__name__})"
            )
            found = diagnose(batch, self.threshold, parts.tokenizer, note=note)
        log.warning("%s", found.message)
        return found.metrics()
