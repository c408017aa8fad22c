"""The parity probe (`lmrl.trainer.parity`): each usual cause of an engine-vs-trainer gap,
injected, is named; an fp32 engine in sync raises nothing."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from lmrl.batch import Batch
from lmrl.config import load_config
from lmrl.models.tiny import build_tokenizer
from lmrl.rollout.copy import CopyEngine
from lmrl.trainer import Trainer, build_run
from lmrl.trainer.parity import CAUSES, GAP_KEY, LABELS, ParityProbe, diagnose


def _trainer(workspace, overrides, run_dir, *extra, engine=None) -> Trainer:
    cfg = load_config(None, overrides(workspace, run_dir, "trainer.save_freq=-1", *extra))
    parts = build_run(cfg)
    if engine is not None:
        parts = dataclasses.replace(parts, engine=engine(parts))
    return Trainer(parts, cfg.trainer)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("parity:")]


def _check_named(trainer, caplog, cause: str) -> dict[str, float]:
    with caplog.at_level(logging.WARNING, logger="lmrl.trainer"):
        metrics = trainer.step()
    said = _warnings(caplog)
    assert len(said) == 1 and f"Cause: {LABELS[cause]}:" in said[0], said
    assert metrics["parity/cause"] == CAUSES.index(cause)
    assert metrics["parity/gap"] > trainer.parity.threshold
    return metrics


def test_an_fp32_engine_in_sync_raises_nothing(tiny_workspace, tiny_overrides, tmp_path, caplog):
    trainer = _trainer(tiny_workspace, tiny_overrides, tmp_path)  # the default threshold
    assert trainer.parity.threshold == 0.05
    with caplog.at_level(logging.WARNING, logger="lmrl.trainer"):
        history = [trainer.step() for _ in range(2)]
    assert all(m["actor/old_log_prob_recomputed"] == 1.0 for m in history)  # the gap measured
    assert not _warnings(caplog) and not any(k.startswith("parity/") for m in history for k in m)


def test_stale_weights_are_named(tiny_workspace, tiny_overrides, tmp_path, caplog):
    """A separate fp32 copy whose automatic sync is skipped, then the actor changes."""

    def stale_copy(parts):
        engine = CopyEngine(parts.policy, parts.tokenizer, dtype="float32", seed=0)
        engine._sync_if_changed = lambda: None  # the skipped sync
        return engine

    trainer = _trainer(tiny_workspace, tiny_overrides, tmp_path, "trainer.parity_threshold=1e-3",
                       engine=stale_copy)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an update the engine never sees
        for p in trainer.parts.policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    m = _check_named(trainer, caplog, "stale_weights")
    assert m["parity/stale_gap_after_sync"] < 1e-4 < m["parity/stale_gap_before_sync"]


def test_dtype_is_named_for_a_bf16_engine(tiny_workspace, tiny_overrides, tmp_path, caplog):
    # the bf16 copy's gap on the tiny model is ~1e-3 a token (test_copy_engine)
    trainer = _trainer(tiny_workspace, tiny_overrides, tmp_path, "rollout.dtype=bfloat16",
                       "trainer.parity_threshold=1e-4")  # fmt: skip
    m = _check_named(trainer, caplog, "dtype")
    assert "bfloat16" in _warnings(caplog)[0]
    assert m["parity/stale_gap_before_sync"] == m["parity/stale_gap_after_sync"]  # in sync
    # once per run: the next step's gap is as large, and nothing more is said
    caplog.clear()
    assert "parity/cause" not in trainer.step() and not _warnings(caplog)


def test_a_batch_shape_dependent_model_is_named(tiny_workspace, tiny_overrides, tmp_path, caplog):
    """A batch-variant kernel: the final norm's output scales with the rows of its batch, and
    the trainer scores 2 rows at a time (a group of 2: one packed sequence) while the engine
    decodes 8; recomputing with every row its own sequence names it."""
    trainer = _trainer(tiny_workspace, tiny_overrides, tmp_path, "trainer.parity_threshold=1e-3",
                       "rollout.log_prob_micro_batch_size=2")  # fmt: skip
    norm = trainer.parts.policy.model.norm
    norm.register_forward_hook(lambda module, args, out: out * (1 + 0.05 * out.shape[0]))
    m = _check_named(trainer, caplog, "micro_batch")
    assert m["parity/micro_batch_shift"] >= 0.5 * m["parity/gap"]


# ----------------------------------------------------------- tokenization (by hand)
E_ACUTE = [101, 204, 129]  # "e" + U+0301 as bytes: NFC re-encodes it as "é" = [195, 169]


def _hand_batch(tok, rows: list[list[int]], gaps: list[float]) -> Batch:
    """Prompts "1", responses ``rows`` (right-padded), the trainer's log-probs ``gaps[i]``
    above the engine's in row i."""
    width = max(map(len, rows))
    pad = tok.pad_token_id
    responses = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[j < len(r) for j in range(width)] for r in rows])
    prompts = torch.full((len(rows), 1), 49)
    rollout = torch.where(mask, torch.tensor(-2.0), torch.tensor(0.0))
    old = torch.where(mask, rollout + torch.tensor(gaps)[:, None], torch.tensor(0.0))
    return Batch({
        "prompts": prompts, "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([torch.ones_like(prompts, dtype=torch.bool), mask], 1),
        "response_mask": mask, "rollout_log_probs": rollout, "old_log_probs": old,
    })  # fmt: skip


def test_responses_that_do_not_round_trip_and_carry_the_gap_are_named():
    tok = build_tokenizer()
    clean = tok("12+3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    dirty = [49, *E_ACUTE, tok.eos_token_id]
    batch = _hand_batch(tok, [clean, clean, dirty, dirty], [0.0, 0.0, 0.4, 0.3])
    found = diagnose(batch, 0.05, tok)
    assert found.cause == "tokenization" and "2 of 4 responses" in found.message
    assert found.figures["parity/tokenization_bad_frac"] == 0.5
    assert found.figures["parity/tokenization_gap_clean"] == 0.0
    assert len(found.message.splitlines()) == 1


def test_under_ray_a_gap_on_every_row_is_unknown_with_its_figures(caplog):
    """Under trainer.backend=ray only the tokenization probe runs; a gap that every row
    carries is not tokenization, and the one line says what was measured and why no more."""
    tok = build_tokenizer()
    clean = tok("12+3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    dirty = [49, *E_ACUTE, tok.eos_token_id]
    batch = _hand_batch(tok, [clean, dirty], [0.2, 0.2])
    parts = SimpleNamespace(backend=object(), tokenizer=tok, actor=None, engine=None)
    probe, gap = ParityProbe(0.05), {GAP_KEY: torch.tensor(0.2)}
    with caplog.at_level(logging.WARNING, logger="lmrl.trainer"):
        metrics = probe(batch, gap, parts)
        assert probe(batch, gap, parts) == {}  # once per run
    (said,) = _warnings(caplog)
    assert metrics["parity/cause"] == CAUSES.index("unknown") and "Cause: unknown:" in said
    assert "gap=0.2" in said and said.endswith(
        "(the actor and the engine live in worker processes)"
    )


@pytest.mark.parametrize("threshold", [0, None, -1.0])
def test_a_threshold_of_zero_or_null_turns_the_probe_off(threshold):
    probe = ParityProbe(threshold)
    assert probe(None, {"rollout/actor_logprob_abs_diff": torch.tensor(9.0)}, None) == {}
