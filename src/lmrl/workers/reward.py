"""Reward scoring as a worker: the same object in the driver (local backend) and in every rank
of a Ray group, built from the config's ``reward`` and ``reward_model`` sections.

The score of a sample is its rule reward (the score functions of its data source, or the
user's reward file, through the reward manager), plus ``reward_model.coef`` times a reward
model's score when ``reward_model.enable``; with ``reward_model.rule_reward=false`` the model's
score alone (verl's behaviour when a reward model is on), and then the data needs no scorer.
The total sits on the last response token, as the manager places the rule reward.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import numpy as np
import torch

from lmrl.batch import Batch, last_true
from lmrl.config import Config, ConfigError
from lmrl.models.reward_model import RewardModel
from lmrl.rewards import load_reward_fn, make_reward_manager
from lmrl.rewards.result import RewardResult
from lmrl.rewards.scorers import scorer_option_errors
from lmrl.workers.precision import Precision

__all__ = ["RewardWorker", "build_reward"]


class RewardWorker:
    """Rule rewards and a reward model's score, as one reward manager (a ``RewardRole``).

    Args:
        manager: the rule reward manager (``lmrl.rewards.make_reward_manager``), or None for
            the model's score alone.
        model: the reward model, or None.
        coef: the weight of the model's score.
        precision: the run's (``lmrl.workers.precision``): the model scores under its
            autocast (bf16 compute on a GPU by default); the score is added in fp32.
    """

    def __init__(
        self,
        manager,
        model: RewardModel | None = None,
        coef: float = 1.0,
        precision: Precision | None = None,
    ) -> None:
        if manager is None and model is None:
            raise ValueError("a RewardWorker needs a reward manager, a reward model, or both")
        self.manager = manager
        self.model = model
        self.coef = coef
        self.precision = precision

    def __call__(self, batch: Batch) -> RewardResult:
        """``token_level_scores`` (B, T) of the batch; extras per sample; counters."""
        if self.manager is not None:
            result = self.manager(batch)
        else:
            mask = batch["response_mask"]
            result = RewardResult(
                token_level_scores=torch.zeros(mask.shape, dtype=torch.float32),
                extras={"score": np.zeros(len(batch))},
                metrics={},
            )
        if self.model is None:
            return result
        with self.precision.autocast() if self.precision is not None else nullcontext():
            rm = self.model(batch).float()  # (B,)
        scores = result.token_level_scores.clone()
        last = last_true(batch["response_mask"]).to(scores.device)
        rows = torch.arange(len(scores), device=scores.device)
        scores[rows, last] += self.coef * rm.to(scores.device, scores.dtype)
        extras = dict(result.extras) | {"rm_score": rm.double().numpy()}
        return dataclasses.replace(result, token_level_scores=scores, extras=extras)

    def check_dataset(self, dataset) -> None:
        """Load-time check of the rule scorers (nothing to check for the model alone)."""
        if self.manager is not None:
            self.manager.check_dataset(dataset)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def build_reward(cfg: Config, tokenizer, device=None):
    """The run's reward scoring from its ``reward`` and ``reward_model`` sections.

    Without a reward model this is the rule reward manager itself.

    Args:
        cfg: the resolved config.
        tokenizer: the policy's tokenizer (responses are decoded with it).
        device: where the reward model runs.
    """
    rm_cfg = cfg.reward_model
    manager = _rule_manager(cfg, tokenizer) if rm_cfg.rule_reward or not rm_cfg.enable else None
    if not rm_cfg.enable:
        return manager
    try:
        model = RewardModel.from_config(rm_cfg, tokenizer, device or "cpu")
    except BaseException:
        if manager is not None:
            manager.close()
        raise
    return RewardWorker(
        manager, model, rm_cfg.coef, Precision.from_config(cfg.model, device or "cpu")
    )


def _rule_manager(cfg: Config, tokenizer):
    r = cfg.reward
    problems = scorer_option_errors(r.scorer_options or {})
    if problems:
        raise ConfigError(problems)
    custom = r.custom_reward_function
    reward_fns = (
        load_reward_fn(custom.path, custom.name, kwargs=custom.reward_kwargs)
        if custom.path
        else None
    )
    options = {}
    if r.manager == "dapo":
        options = {
            "overlong_buffer": dict(r.overlong_buffer),
            "max_response_length": cfg.data.max_response_length,
        }
    return make_reward_manager(
        r.manager, tokenizer, reward_fns=reward_fns, num_workers=r.num_workers,
        timeout_s=r.timeout_s, reward_fn_key=cfg.data.reward_fn_key,
        max_error_fraction=r.max_error_fraction, scorer_options=r.scorer_options or None,
        **options,
    )  # fmt: skip
