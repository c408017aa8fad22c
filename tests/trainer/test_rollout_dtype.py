"""``rollout.dtype=bfloat16``: a bf16 rollout beside the fp32 anchor, on this CPU.

The gap is real (the engine samples with a bf16 copy of the weights), measured every step,
and rollout correction reacts to it, while an fp32 engine gives it nothing to react to.
"""

from __future__ import annotations

import pytest

from lmrl.config import load_config
from lmrl.trainer import Trainer, build_run

# the bf16 copy's per-token gap on the tiny model is ~1e-3 (test_copy_engine), the fp32
# engine's ~1e-7: bounds of 1 +- 5e-4 sit between the two
TIGHT = ["rollout.correction.threshold=1.0005", "rollout.correction.threshold_lower=0.9995"]


def _first_step(workspace, overrides, run_dir, *extra):
    cfg = load_config(None, overrides(workspace, run_dir, "trainer.total_training_steps=1",
                                      "trainer.save_freq=-1", *extra))  # fmt: skip
    return Trainer(build_run(cfg), cfg.trainer).fit()[0]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_correction_reacts_to_the_bf16_gap_and_not_to_fp32(
    tiny_workspace, tiny_overrides, tmp_path, level, mode
):
    extra = ["rollout.log_prob_mode=rollout_correction", f"rollout.correction.level={level}",
             f"rollout.correction.mode={mode}", *TIGHT]  # fmt: skip
    fp32 = _first_step(tiny_workspace, tiny_overrides, tmp_path / "fp32", *extra)
    bf16 = _first_step(tiny_workspace, tiny_overrides, tmp_path / "bf16", *extra,
                       "rollout.dtype=bfloat16")  # fmt: skip
    acted = "rollout_corr/is_truncated_fraction" if mode == "truncate" else (
        "rollout_corr/is_masked_fraction")  # fmt: skip
    assert fp32[acted] == 0.0 and bf16[acted] > 0.0, (fp32[acted], bf16[acted])
    assert fp32["rollout/mismatch_k3"] < 1e-10 < 1e-8 < bf16["rollout/mismatch_k3"]
    assert fp32["rollout/ratio_outside_frac"] == 0.0  # the [0.9, 1.1] measure: bf16's is ~0 here
    assert bf16["rollout/actor_logprob_abs_diff"] > 100 * fp32["rollout/actor_logprob_abs_diff"]


def test_the_gap_is_logged_in_decoupled_mode_too(tiny_workspace, tiny_overrides, tmp_path):
    """Decoupled log-probs with a bf16 engine: old log-probs are recomputed (never the update's
    own forward, which would hide the gap) and the gap is logged."""
    m = _first_step(tiny_workspace, tiny_overrides, tmp_path / "run", "rollout.dtype=bfloat16",
                    "actor.ppo_mini_batch_size=4")  # fmt: skip
    assert m["actor/old_log_prob_recomputed"] == 1.0
    assert m["rollout/mismatch_k3"] > 1e-8 and "rollout_corr/is_weight_mean" not in m
