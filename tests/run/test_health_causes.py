"""The run doctor names a warm start stuck on the commonest answer (its validation no better
than the answers' prior, its answers collapsed onto a few strings) at the first validation,
and a divergence (entropy climbing while the score falls), which the rollback acts on. Each
fires on the sequence that shows it and stays quiet on a healthy one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lmrl.run.health import ZERO_SPREAD_KEY, RunHealth
from lmrl.run.loop import RunLoop

ACC, PRIOR = "val/count/acc", "val/count/prior_acc"
RECORDED = Path(__file__).parents[1] / "logging" / "data" / "grpo_digits" / "metrics.jsonl"


def _feed(health: RunHealth, rows: list[dict]) -> list[str]:
    return [w for row in rows for w in health.check(row)]


def _spread(distinct: float, truths: float, top: float, truth_top: float) -> dict[str, float]:
    return {
        "val/count/answers/distinct": distinct,
        "val/count/answers/truths": truths,
        "val/count/answers/top_share": top,
        "val/count/answers/truth_top_share": truth_top,
    }


# ---------------------------------------------------------------------------- the prior
def test_a_validation_equal_to_the_prior_is_named_before_the_first_step_with_its_fix():
    health = RunHealth(None)
    health.answer_texts = {"count": ("1", "1")}
    said = health.baseline({ACC: 0.3125, PRIOR: 0.3125, **_spread(3, 5, 0.9, 0.3)})
    assert len(said) == 1
    assert said[0].startswith("the policy does not beat the answers' prior before the first step")
    assert (
        "validation on count 0.312 equals the answers' prior 0.312 (always answering '1'" in said[0]
    )
    assert "it gives '1' to 90% of them" in said[0]
    assert "a sweep will not help" in said[0] and "longer or better SFT" in said[0]
    assert "data.curriculum.enable=true" in said[0] and "easier prompts" in said[0]
    # said once: the same validation later says nothing new
    row = {ACC: 0.3125, PRIOR: 0.3125, "training/step": 5, **_spread(3, 5, 0.9, 0.3)}
    assert _feed(health, [row]) == []


def test_a_policy_that_beats_the_prior_or_a_prior_of_zero_is_quiet():
    beats = RunHealth(None)
    assert beats.baseline({ACC: 0.45, PRIOR: 0.31, **_spread(5, 5, 0.3, 0.3)}) == []
    assert beats.cause is None
    zero = RunHealth(None)  # digits: no answer repeats, the prior scores 0
    assert zero.baseline({"val/digits/acc": 0.0, "val/digits/prior_acc": 0.0}) == []


def test_answers_collapsed_onto_a_few_strings_are_named_with_both_spreads():
    health = RunHealth(None)
    health.answer_texts = {"count": ("2", "1")}
    said = health.baseline({ACC: 0.40, PRIOR: 0.20, **_spread(2, 40, 0.7, 0.05)})
    assert len(said) == 1 and said[0].startswith("the policy's answers collapse onto a few")
    assert (
        "collapse onto 2 distinct strings ('2' is 70% of them) where the ground truths hold 40"
        in said[0]
    )
    assert "(the commonest is 5% of them)" in said[0] and "a sweep will not help" in said[0]
    # one answer for most prompts while the ground truths spread: collapsed too
    top = RunHealth(None)
    assert len(top.baseline({ACC: 0.5, PRIOR: 0.2, **_spread(8, 10, 0.6, 0.2)})) == 1
    # answers as spread as the truths: quiet; few distinct ground truths: not judged
    assert RunHealth(None).baseline({ACC: 0.5, PRIOR: 0.2, **_spread(9, 10, 0.2, 0.2)}) == []
    assert RunHealth(None).baseline({ACC: 0.5, PRIOR: 0.2, **_spread(1, 3, 1.0, 0.4)}) == []


def test_both_causes_at_once_are_one_warning():
    health = RunHealth(None)
    health.answer_texts = {"count": ("1", "1")}
    said = health.baseline({ACC: 0.2, PRIOR: 0.2, **_spread(1, 5, 1.0, 0.2)})
    assert len(said) == 1 and "equals the answers' prior 0.200" in said[0]
    assert "collapse onto 1 distinct string (" in said[0]


def test_the_warnings_that_advise_a_sweep_name_the_cause_instead():
    """The motivating run: validation flat at the prior, groups alike; no sweep advice."""
    health = RunHealth(None)
    health.answer_texts = {"count": ("1", "1")}
    health.baseline({ACC: 0.312, PRIOR: 0.312, **_spread(1, 5, 1.0, 0.3)})
    rows = [{"critic/score/mean": 0.31, ZERO_SPREAD_KEY: 0.95, ACC: 0.312, PRIOR: 0.312,
             "training/step": s, **_spread(1, 5, 1.0, 0.3)} for s in range(1, 8)]  # fmt: skip
    said = _feed(health, rows)
    alike = [w for w in said if "scored all alike" in w]
    flat = [w for w in said if "validation has stayed at" in w]
    assert len(alike) == 1 and len(flat) == 1
    for warning in alike + flat:
        assert "the cause is the warm start" in warning.lower() and "lmrl sweep" not in warning
        assert "filter_groups" not in warning and "equals the answers' prior 0.312" in warning
    # without the cause, the same run's warnings keep their own advice
    plain = RunHealth(None)
    plain.baseline({ACC: 0.312})
    said = _feed(plain, [{k: v for k, v in r.items() if "/answers/" not in k and k != PRIOR}
                         for r in rows])  # fmt: skip
    assert any("lmrl sweep" in w for w in said) and any("filter_groups" in w for w in said)


def test_a_first_validation_after_some_steps_still_names_the_warm_start():
    """trainer.val_before_train=false: the first validation is at step 10."""
    health = RunHealth(None)
    said = _feed(health, [{ACC: 0.2, PRIOR: 0.2, "training/step": 10, **_spread(1, 5, 1.0, 0.2)}])
    assert len(said) == 1 and said[0].startswith("the policy does not beat the answers' prior at")
    assert "at step 10" in said[0] and "longer or better SFT" in said[0]


def test_answers_that_collapse_during_rl_after_a_fine_start_are_rls_with_rls_fix():
    health = RunHealth(None)
    health.answer_texts = {"count": ("1", "1")}
    assert health.baseline({ACC: 0.5, PRIOR: 0.2, **_spread(5, 5, 0.2, 0.2)}) == []
    said = _feed(health, [{ACC: 0.2, PRIOR: 0.2, "training/step": 10, **_spread(1, 5, 1.0, 0.2)}])
    assert len(said) == 1 and said[0].startswith(
        "RL drove the policy onto a few answers at step 10"
    )
    assert "where at step 0 it did not" in said[0] and "actor.optim.lr" in said[0]
    assert "trainer.max_rollbacks=2" in said[0] and "longer or better SFT" not in said[0]
    assert health.cause is not None and health.cause.startswith("the cause is RL's")
    _feed(health, [{ACC: 0.6, PRIOR: 0.2, "training/step": 20, **_spread(5, 5, 0.2, 0.2)}])
    assert health.cause is None  # beats the prior again, its answers spread
    health.rewind(0)  # rolled back: said again if it happens again
    assert health.answers_fine == {"count": 0} and "rl_answers" not in health.said


# ---------------------------------------------------------------------------- divergence
def _diverging(steps: int = 12) -> list[dict]:
    """Entropy climbing 0.8 -> 2.5 nats while the train score falls 0.6 -> 0.2."""
    entropy = np.linspace(0.8, 2.5, steps)
    score = np.linspace(0.6, 0.2, steps)
    return [{"actor/entropy": float(e), "critic/score/mean": float(s), "training/step": i + 1}
            for i, (e, s) in enumerate(zip(entropy, score, strict=True))]  # fmt: skip


def test_entropy_climbing_while_the_score_falls_is_a_divergence_that_sets_the_rollback_flag():
    health = RunHealth(vocab_size=259)
    health.baseline({"val/digits/acc": 0.4})
    said = _feed(health, _diverging())
    diverge = [w for w in said if "diverging" in w]
    assert len(diverge) == 1
    assert "actor.optim.lr" in diverge[0] and "actor.use_kl_loss=true" in diverge[0]
    assert "algorithm.use_kl_in_reward=true" in diverge[0]
    assert "trainer.max_rollbacks=2" in diverge[0]
    assert health.collapse == (0, 0.4, 0.4)  # back to the best validation, step 0
    health.rewind(0)
    assert health.collapse is None and "diverge" not in health.said


def test_a_rising_entropy_with_a_rising_score_or_a_noisy_one_is_quiet():
    rising = [{**r, "critic/score/mean": 0.2 + 0.03 * i} for i, r in enumerate(_diverging())]
    health = RunHealth(vocab_size=259)
    assert _feed(health, rising) == [] and health.collapse is None
    rng = np.random.default_rng(0)  # entropy wandering around 1 nat, the score falling
    noisy = [{**r, "actor/entropy": float(1 + 0.1 * rng.standard_normal())}
             for r in _diverging(20)]  # fmt: skip
    health = RunHealth(vocab_size=259)
    assert not any("diverging" in w for w in _feed(health, noisy)) and health.collapse is None


def test_a_divergence_is_rolled_back_by_the_run_doctor(tmp_path):
    """The rollback program of the kill tests, with the real health checks: a divergence seen
    while the lr is the first one sends the run back to its best validation at a lower lr."""
    from tests.run.rollback_run import LrProgram, Settings

    class Diverging(LrProgram):
        def __init__(self, run_dir: Path) -> None:
            super().__init__(run_dir)
            self.health = RunHealth(None)

        def step(self):
            out = super().step()
            s = self.global_step
            diverging = self.lr == 1.0 and s > 2  # entropy up, score down after step 2
            entropy = 0.5 + 0.3 * (s - 2) if diverging else 0.5 + 0.01 * (s % 2)
            score = 0.6 - 0.05 * (s - 2) if diverging else 0.6
            return out | {"actor/entropy": entropy, "critic/score/mean": score,
                          "training/step": float(s)}  # fmt: skip

    class Longer(Settings):
        def rollbacks(self) -> tuple[int, float]:
            return 1, 0.5

    program = Diverging(tmp_path)
    program.total_steps = 16
    loop = RunLoop(program, Longer())  # type: ignore[arg-type]
    loop.run()
    logged = [m for _, m in program.trackers.logged if "doctor/rollback" in m]
    assert len(logged) == 1 and logged[0]["doctor/lr_scale"] == 0.5
    assert logged[0]["doctor/rolled_back_from"] > 2
    assert program.lr == 0.5 and program.global_step == 16


# ---------------------------------------------------------------------------- healthy runs
def _demo_like(steps: int = 60, test_freq: int = 10) -> list[dict]:
    """Shaped like the demo's healthy run: a warm start at 0.3 greedy accuracy on digits (no
    answer repeats: the prior scores 0), the entropy falling slowly, the score and validation
    rising, few groups alike."""
    rng = np.random.default_rng(1)
    rows = []
    for s in range(1, steps + 1):
        row = {
            "actor/entropy": float(1.2 * np.exp(-s / 80) + 0.05 * rng.standard_normal()),
            "critic/score/mean": float(0.45 + 0.004 * s + 0.03 * rng.standard_normal()),
            ZERO_SPREAD_KEY: float(0.3 + 0.1 * rng.random()),
            "response_length/clip_ratio": 0.0,
            "training/step": float(s),
        }
        if s % test_freq == 0:
            row |= {"val/digits/acc": 0.3 + 0.005 * s, "val/digits/prior_acc": 0.0,
                    "val/digits/answers/distinct": 60.0, "val/digits/answers/truths": 64.0,
                    "val/digits/answers/top_share": 2 / 64,
                    "val/digits/answers/truth_top_share": 1 / 64}  # fmt: skip
        rows.append(row)
    return rows


def test_the_demos_healthy_runs_stay_quiet():
    health = RunHealth(vocab_size=259)
    health.answer_texts = {"digits": ("4321", "12345")}
    base = {"val/digits/acc": 0.3, "val/digits/reward/mean": 0.6, "val/digits/prior_acc": 0.0,
            "val/digits/answers/distinct": 58.0, "val/digits/answers/truths": 64.0,
            "val/digits/answers/top_share": 2 / 64, "val/digits/answers/truth_top_share": 1 / 64}  # fmt: skip
    assert health.baseline(base) == []
    assert _feed(health, _demo_like()) == [] and health.collapse is None
    # the 15 recorded steps of `lmrl train` (GRPO on digits) say only what they said before
    recorded = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    said = _feed(RunHealth(vocab_size=259), recorded)
    assert not any("diverging" in w or "answers' prior" in w or "collapse onto" in w
                   for w in said)  # fmt: skip
