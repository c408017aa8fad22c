"""Reward scoring as a worker: the same object in the driver (local backend) and in every
rank of a Ray group, built from the config's ``reward`` section."""

from __future__ import annotations

import dataclasses

from lmrl.config import Config
from lmrl.rewards import load_reward_fn, make_reward_manager

__all__ = ["build_reward"]


def build_reward(cfg: Config, tokenizer, device=None):
    """The run's reward scoring from its ``reward`` section: the rule reward manager (the
    scorers of each data source, or the user's reward file), with its worker processes.

    Args:
        cfg: the resolved config.
        tokenizer: the policy's tokenizer (responses are decoded with it).
        device: where a model-based scorer would run (unused by rule rewards).
    """
    r = cfg.reward
    custom = r.custom_reward_function
    reward_fns = (
        load_reward_fn(custom.path, custom.name, kwargs=custom.reward_kwargs)
        if custom.path
        else None
    )
    options = {}
    if r.manager == "dapo":
        options = {
            "overlong_buffer": dataclasses.asdict(r.overlong_buffer),
            "max_response_length": cfg.data.max_response_length,
        }
    return make_reward_manager(
        r.manager, tokenizer, reward_fns=reward_fns, num_workers=r.num_workers,
        timeout_s=r.timeout_s, reward_fn_key=cfg.data.reward_fn_key,
        max_error_fraction=r.max_error_fraction, **options,
    )  # fmt: skip
