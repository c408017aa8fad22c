"""Every key a `lmrl.batch.Batch` may hold, declared once: dtype, shape, role, meaning, writer.

The RL step's batch (text and, to come, vision-language) and Flow-GRPO's are declared here,
grouped by meaning (OpenRLHF's ``experience.py``). Each `Key` names the one stage that writes
it (`STAGES`; no stage rewrites a key another stage wrote: a stage that narrows what trains
writes its own key, e.g. ``loss_mask``) and the readers whose key sets are derived from it
(`keys`): a forward's micro-batch (``forward``, its must-haves ``needed_by="forward"``), a
worker group's row-wise pass (``map_rows``), the actor's and the critic's update
(``actor_update``, ``critic_update``). Adding a key to a stage's input is one line here.

Shapes use the letters of the style guide: ``B`` rows (the ``G`` samples of a prompt
contiguous), ``P`` prompt length (left-padded), ``T`` response length (right-padded), ``K``
denoising steps of a flow trajectory. The role says what a row holds: ``token`` one value per
response token (B, T), aligned with ``responses``; ``sequence`` one per prompt-and-response
position (B, P+T); ``prompt`` (B, P); ``sample`` one value or block per row in a tensor (B,
...); ``column`` one Python value per row (a non-tensor column, dtype ``"object"``); ``step``
one per denoising step (B, K).

Other programs build batches with the same keys in the same meaning and their own writers:
SFT's micro-batch (``input_ids``, ``attention_mask``, ``responses``, ``loss_mask``: the data's
trained tokens) and the memory probe's worst-case step. A prompts batch (the data's) holds
``input_ids``, ``attention_mask`` and ``position_ids`` (B, P); the rollout's batch replaces them
by the (B, P+T) ones declared here.

With ``LMRL_STRICT_BATCH=1`` in the environment (the tests set it) a `Batch` refuses to write a
key not declared here, or a tensor under a column's key and the reverse (`check_write`).

Placement: ``lmrl.batch.schema``, inside the ``batch`` package, so that every package the
import table lets read a `Batch` may read its schema too, and the schema imports nothing of
lmrl (only torch).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "ENV",
    "KEYS",
    "ROLES",
    "STAGES",
    "ColumnKey",
    "Key",
    "TensorKey",
    "UndeclaredKeyError",
    "check_write",
    "keys",
    "strict",
]

ENV = "LMRL_STRICT_BATCH"  # "1": a Batch refuses undeclared keys (set by the tests)

ROLES = ("token", "sequence", "prompt", "sample", "column", "step")

#: the stages that write keys, in the order of a step
STAGES: dict[str, str] = {
    "data": "the prompts batch of the dataset (lmrl.data.dataset.RLDataset.collate)",
    "rollout": "the engine's output (lmrl.rollout.base.finish_rollout, the agent loop)",
    "baseline": "ReMax's greedy baseline (lmrl.trainer.stages.greedy_baseline)",
    "reward": "the reward manager's scores (lmrl.trainer.stages.record)",
    "old_log_prob": "stage 3: pi_old of the ratio (the actor, or the rollout's in bypass mode)",
    "correction": "rollout correction's importance weights and rejection mask",
    "ref": "stage 4: the reference policy's log-probs",
    "values": "stage 5: the critic's values",
    "adv": "stage 6: KL in the reward, the advantage estimator",
    "layout": "lmrl.models.layout.with_row_layout, on a stage's own copy before a forward",
    "async": "the rollout thread ahead (lmrl.trainer.ahead), stamping the weights' version",
    "flow_rollout": "Flow-GRPO's sampler (lmrl.flow.rollout.FlowSampler.sample)",
    "flow_update": "Flow-GRPO's update, its per-row work batch (lmrl.flow.grpo)",
}


@dataclass(frozen=True)
class Key:
    """One declared `Batch` key.

    ``dtype``: a torch dtype (a tuple: any of them), or ``"object"`` for a non-tensor column.
    ``shape``: as text, ``(B, T)``. ``read_by``: the readers whose key sets hold it when the
    batch has it; ``needed_by``: the readers that fail without it (readers too).
    """

    name: str
    dtype: torch.dtype | tuple[torch.dtype, ...] | str
    shape: str
    role: str
    writer: str
    meaning: str
    group: str
    read_by: tuple[str, ...] = ()
    needed_by: tuple[str, ...] = ()

    @property
    def is_tensor(self) -> bool:
        return self.dtype != "object"

    @property
    def dtypes(self) -> tuple:
        """The dtypes a tensor under this key may have (empty for a column)."""
        if not self.is_tensor:
            return ()
        return self.dtype if isinstance(self.dtype, tuple) else (self.dtype,)


_F32, _LONG, _BOOL = torch.float32, torch.long, torch.bool
_FWD = ("forward", "map_rows", "actor_update", "critic_update")  # every forward's input
_UPDATE = ("map_rows", "actor_update", "critic_update")  # rows' tokens: split and masked by

# (name, dtype, shape, role, writer, meaning, read_by, needed_by) per group, in order
_GROUPS: dict[str, list[tuple]] = {
    # ------------------------------------------------------------ the prompt's data columns
    "prompt": [
        ("data_source", "object", "(B,)", "column", "data",
         "str: the task or dataset name; chooses the score function"),
        ("ground_truth", "object", "(B,)", "column", "data",
         "the reference answer the score function compares with"),
        ("extra_info", "object", "(B,)", "column", "data",
         "dict: the row's extra fields (split, index, task fields), passed to the scorer"),
        ("raw_prompt", "object", "(B,)", "column", "data",
         "the prompt before the chat template: a string or chat messages"),
        ("ability", "object", "(B,)", "column", "data", "str: the task's category"),
        ("index", "object", "(B,)", "column", "data", "the row's index in its source"),
        ("uid", "object", "(B,)", "column", "rollout",
         "str: the prompt's group id, shared by its G samples (added when the prompts lack it)"),
    ],
    # ------------------------------------------------------------ the rollout's tokens
    "tokens": [
        ("input_ids", _LONG, "(B, P+T)", "sequence", "rollout",
         "cat(prompts, responses)", _FWD, ("forward",)),
        ("attention_mask", _BOOL, "(B, P+T)", "sequence", "rollout",
         "True on every real token the model reads (a multi-turn rollout's observations too)",
         _FWD, ("forward",)),
        ("position_ids", _LONG, "(B, P+T); (B, 3, P+T) with M-RoPE", "sequence", "rollout",
         "each token's position (0 on the padding); 3-D for a vision-language model, from the "
         "model's own rope-index function", _FWD),
        ("prompts", _LONG, "(B, P)", "prompt", "rollout",
         "the prompt's ids, left-padded, repeated for the G samples"),
        ("responses", _LONG, "(B, T)", "token", "rollout",
         "the response's ids, right-padded (a multi-turn rollout's observations inside)",
         _FWD, ("forward",)),
        ("response_mask", _BOOL, "(B, T)", "token", "rollout",
         "True on the tokens the policy generated (state masking: observations False)",
         _UPDATE),
        ("rollout_log_probs", _F32, "(B, T)", "token", "rollout",
         "the engine's log-probs of the sampled tokens (0 outside response_mask)"),
    ],
    # ------------------------------------------------------------ vision-language inputs
    "vision": [
        ("pixel_values", "object", "(B,)", "column", "data",
         "per sample a float tensor (patches, D): the processor's image patches"),
        ("image_grid_thw", "object", "(B,)", "column", "data",
         "per sample a long tensor (images, 3): each image's (t, h, w) patch grid"),
    ],
    # ------------------------------------------------------------ multi-turn counters
    "agent": [
        ("agent_turns", _F32, "(B,)", "sample", "rollout", "turns of the row"),
        ("agent_tool_calls", _F32, "(B,)", "sample", "rollout", "tool calls of the row"),
        ("agent_valid_calls", _F32, "(B,)", "sample", "rollout", "calls that parsed"),
        ("agent_tool_errors", _F32, "(B,)", "sample", "rollout", "calls that erred"),
        ("agent_tool_timeouts", _F32, "(B,)", "sample", "rollout", "calls that timed out"),
        ("agent_obs_tokens", _F32, "(B,)", "sample", "rollout", "observation tokens"),
        ("agent_answered", _F32, "(B,)", "sample", "rollout", "1 when the row answered"),
    ],
    # ------------------------------------------------------------ scores
    "reward": [
        ("token_level_scores", _F32, "(B, T)", "token", "reward",
         "the reward, on each row's last generated token (a process reward: on several)"),
        ("scored_mask", _BOOL, "(B,)", "sample", "reward",
         "False on a row no reward function scored (each returned None): out of the "
         "advantages' group statistics, of the loss and of the critic's value loss",
         ("critic_update",)),
        ("reward_texts", "object", "(B,)", "column", "reward",
         "dict: the reward's text extras of the sample ({} without), for the generations log"),
        ("reward_baselines", _F32, "(B,)", "sample", "baseline",
         "ReMax: the reward of the prompt's greedy response"),
    ],
    # ------------------------------------------------------------ log-probs
    "log_probs": [
        ("old_log_probs", _F32, "(B, T)", "token", "old_log_prob",
         "pi_old's log-probs, the PPO ratio's anchor", ("actor_update",)),
        ("ref_log_probs", _F32, "(B, T)", "token", "ref",
         "the reference policy's log-probs (KL loss or KL in the reward)", ("actor_update",)),
        ("rollout_is_weights", _F32, "(B, T)", "token", "correction",
         "rollout correction's importance weights pi_old / pi_rollout (truncated)",
         ("actor_update",)),
        ("loss_mask", _BOOL, "(B, T)", "token", "correction",
         "the tokens that train: response_mask less rollout correction's rejected ones and "
         "the rows no reward scored (SFT: the data's trained tokens)", ("actor_update",)),
    ],
    # ------------------------------------------------------------ values and advantages
    "advantage": [
        ("values", _F32, "(B, T)", "token", "values",
         "the critic's values of the response positions", ("critic_update",)),
        ("token_level_rewards", _F32, "(B, T)", "token", "adv",
         "token_level_scores less the KL penalty when KL is in the reward"),
        ("advantages", _F32, "(B, T)", "token", "adv", "the estimator's advantages",
         ("actor_update",)),
        ("returns", _F32, "(B, T)", "token", "adv", "the critic's targets",
         ("critic_update",)),
    ],
    # ------------------------------------------------------------ bookkeeping
    "layout": [
        ("row_layout", "object", "(B,)", "column", "layout",
         "a RowSpan per row: its attended columns and prompt group, read on the host",
         ("forward",)),
        ("prompt_group", _LONG, "(B,)", "sample", "layout",
         "the row's prompt, numbered over the batch (rows sharing a prompt share it)",
         ("forward",)),
    ],
    "async": [
        ("weights_version", _LONG, "(B,)", "sample", "async",
         "the version of the weights that generated the row"),
    ],
    # ------------------------------------------------------------ Flow-GRPO's trajectory
    "flow": [
        ("latents", _F32, "(B, K, ...)", "step", "flow_rollout", "x before each step"),
        ("next_latents", _F32, "(B, K, ...)", "step", "flow_rollout", "x after each step"),
        ("log_probs", _F32, "(B, K)", "step", "flow_rollout",
         "each step's log-prob under the sampling policy (0 on ODE steps)"),
        ("timesteps", _F32, "(B, K)", "step", "flow_rollout", "each step's t"),
        ("next_timesteps", _F32, "(B, K)", "step", "flow_rollout", "each step's t_next"),
        ("step_mask", _BOOL, "(B, K)", "step", "flow_rollout",
         "the steps that train (SDE steps, cut by timestep_fraction)"),
        ("images", _F32, "(B, ...)", "sample", "flow_rollout", "the final sample"),
        ("cond", (_F32, _LONG), "(B, ...)", "sample", "flow_rollout",
         "the prompts' conditioning (class ids, attribute ids or text embeddings)"),
    ],
    "flow_update": [
        ("old", _F32, "(B, K)", "step", "flow_update", "the ratio's anchor log-probs"),
        ("adv", _F32, "(B,)", "sample", "flow_update", "the image's advantage"),
        ("row", _LONG, "(B,)", "sample", "flow_update", "the row's index in the batch"),
        ("steps", "object", "(B,)", "column", "flow_update",
         "a bool numpy (K,) per row: its training steps, read once on the host"),
    ],
}  # fmt: skip

KEYS: dict[str, Key] = {
    spec[0]: Key(*spec[:6], group, *spec[6:]) for group, specs in _GROUPS.items() for spec in specs
}


#: the keys of tensors and of columns as types, so that a type checker reads ``batch["responses"]``
#: as a ``torch.Tensor`` and ``batch["uid"]`` as a numpy column (`lmrl.batch.Batch.__getitem__`);
#: tests/test_batch_schema.py holds them equal to `KEYS`
TensorKey = Literal[
    "input_ids",
    "attention_mask",
    "position_ids",
    "prompts",
    "responses",
    "response_mask",
    "rollout_log_probs",
    "agent_turns",
    "agent_tool_calls",
    "agent_valid_calls",
    "agent_tool_errors",
    "agent_tool_timeouts",
    "agent_obs_tokens",
    "agent_answered",
    "token_level_scores",
    "scored_mask",
    "reward_baselines",
    "old_log_probs",
    "ref_log_probs",
    "rollout_is_weights",
    "loss_mask",
    "values",
    "token_level_rewards",
    "advantages",
    "returns",
    "prompt_group",
    "weights_version",
    "latents",
    "next_latents",
    "log_probs",
    "timesteps",
    "next_timesteps",
    "step_mask",
    "images",
    "cond",
    "old",
    "adv",
    "row",
]
ColumnKey = Literal[
    "data_source",
    "ground_truth",
    "extra_info",
    "raw_prompt",
    "ability",
    "index",
    "uid",
    "pixel_values",
    "image_grid_thw",
    "reward_texts",
    "row_layout",
    "steps",
]


def keys(
    *,
    read_by: str | None = None,
    needed_by: str | None = None,
    writer: str | None = None,
    group: str | None = None,
    role: str | None = None,
) -> tuple[str, ...]:
    """The names of the declared keys that match every filter given, in declaration order.

    ``read_by="actor_update"``: the keys the actor's update reads (``needed_by`` keys count as
    read).
    """
    out = []
    for k in KEYS.values():
        if read_by is not None and read_by not in k.read_by + k.needed_by:
            continue
        if needed_by is not None and needed_by not in k.needed_by:
            continue
        if writer is not None and k.writer != writer:
            continue
        if group is not None and k.group != group:
            continue
        if role is not None and k.role != role:
            continue
        out.append(k.name)
    return tuple(out)


class UndeclaredKeyError(ValueError):
    """A `Batch` write of a key that ``lmrl.batch.schema`` does not declare (strict mode)."""


def strict() -> bool:
    """Whether writes are checked against the schema: ``LMRL_STRICT_BATCH`` set, not ``0``."""
    return os.environ.get(ENV, "0") not in ("", "0")


def check_write(key: str, is_tensor: bool) -> None:
    """Raise `UndeclaredKeyError` for a key this module does not declare, or a tensor written
    under a column's key (or a column under a tensor's).

    Raises:
        UndeclaredKeyError: naming the key, the closest declared names and this module.
    """
    spec = KEYS.get(key)
    if spec is None:
        close = difflib.get_close_matches(key, list(KEYS), n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise UndeclaredKeyError(
            f"Batch key {key!r} is not declared{hint}: declare it in lmrl.batch.schema "
            "(src/lmrl/batch/schema.py) with its dtype, shape, role, meaning and writer"
        )
    if spec.is_tensor != is_tensor:
        want = "a tensor" if spec.is_tensor else "a non-tensor column"
        raise UndeclaredKeyError(
            f"Batch key {key!r} is declared {want} in lmrl.batch.schema, got "
            f"{'a tensor' if is_tensor else 'a column'}"
        )
