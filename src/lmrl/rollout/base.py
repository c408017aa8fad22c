"""The generation-engine interface: `SamplingParams`, `RolloutEngine`, and the output layout.

Every engine takes a `Batch` of left-padded prompts and returns a `Batch` of ``B * n`` rows,
the ``n`` samples of a prompt contiguous (rows ``i*n .. i*n+n-1`` come from prompt ``i`` and
share its ``uid``), with the standard keys:

- ``prompts`` (B*n, P) left-padded; ``responses`` (B*n, T) right-padded with the pad id;
- ``input_ids`` = cat(prompts, responses) (B*n, P+T);
- ``attention_mask`` bool (B*n, P+T) = cat(prompt mask, response mask);
- ``position_ids`` (B*n, P+T) = cumsum(attention_mask) - 1, clipped at 0;
- ``response_mask`` bool (B*n, T): True up to and including the first EOS token (or the token
  that completes a stop string), False after; in a multi-turn rollout (`lmrl.rollout.agent`)
  also False on the observation tokens under state masking, while ``attention_mask`` is True
  on them (read, not trained);
- ``rollout_log_probs`` (B*n, T): log-prob of each sampled token under the distribution the
  engine sampled from *before* top-p/top-k truncation, i.e. ``log_softmax(logits / temperature)``
  at the token; 0 outside ``response_mask``. It is what ``compute_log_probs`` returns for the
  same tokens at the same temperature, so bypass mode and rollout correction are exact.

``T`` is the longest response of the batch (at most ``max_new_tokens``). Non-tensor columns
of the prompts (``uid``, ``data_source``, ``ground_truth``, ``extra_info``, ``raw_prompt``...)
are repeated per sample; a ``uid`` (uuid4 string) is made per prompt when the prompts have
none. ``meta["temperature"]`` records the temperature of ``rollout_log_probs``.

The choice made here: engines only sample. They never compute rewards, never decode text for
the batch (the reward manager does), and hold no training state.
"""

from __future__ import annotations

import contextlib
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from lmrl.batch import Batch

__all__ = [
    "CallSeeds",
    "EngineView",
    "RolloutEngine",
    "RowDone",
    "SamplingParams",
    "check_prompts",
    "default_eos_ids",
    "finish_rollout",
    "stop_and_pad_ids",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample continuations; validated on creation.

    Attributes:
        temperature: divides the logits before sampling; also the temperature of
            ``rollout_log_probs``. Must be > 0 when sampling. In greedy mode it only sets the
            temperature of the recorded log-probs (0 is accepted there and means 1).
        top_p: nucleus sampling, keep the smallest set of tokens whose probability reaches
            ``top_p``; 1.0 = off. In (0, 1].
        top_k: keep the ``top_k`` most likely tokens; -1 or 0 = off.
        max_new_tokens: most tokens generated per sample (``data.max_response_length``), >= 1.
        do_sample: True samples; False is greedy decoding (validation).
        stop: strings that end a sample once generated (the completing token is kept).
        seed: seeds this call's sampling (never the global RNG): with a seed, the draws of
            sample ``j`` of the ``i``-th prompt of the batch are a function of (seed, i, j,
            step) alone; None draws a fresh seed from the engine's own generator, which moves
            on from call to call.
        ignore_eos: an EOS id does not end a sample (it is kept as a token); samples end at
            ``max_new_tokens`` or a stop string. verl's ``rollout.ignore_eos``, for benchmarks
            that must generate exactly ``max_new_tokens``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    do_sample: bool = True
    stop: list[str] | tuple[str, ...] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 when sampling, got {self.temperature}; "
                "use do_sample=False for greedy decoding"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (-1 or 0 = off), got {self.top_k!r}")
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", list(self.stop))
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def logprob_temperature(self) -> float:
        """The temperature of ``rollout_log_probs`` (``temperature``, or 1 when it is 0)."""
        return float(self.temperature) if self.temperature > 0 else 1.0


RowDone = Callable[[torch.Tensor, Batch], None]
"""An engine's finished-rows hook: ``hook(rows, block)`` the moment rows of a ``generate`` call
stop: ``rows`` (k,) their places among the call's B*n rows, ``block`` those rows as
``generate`` returns them, as wide as their longest."""


@dataclass
class EngineView:
    """What a caller outside the engine (``lmrl.trainer.parity``) can do with its model.

    Attributes:
        model: the module it generates with, to score given tokens (teacher forcing); None
            when it cannot (vLLM, a Ray group's engine).
        autocast: the context its forward runs in.
        compute: its compute dtype (None when unknown).
        shares_weights: it generates with the actor's own module (never stale).
        sync: forces its weight sync from the actor (None when it has no copy to sync).
    """

    model: nn.Module | None
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    compute: torch.dtype | None = None
    shares_weights: bool = True
    sync: Callable[[], None] | None = None


class RolloutEngine(ABC):
    """A generation engine: left-padded prompts in, ``n`` samples per prompt out.

    Implementations: ``hf`` (`lmrl.rollout.hf.HFEngine`, CPU and GPU), ``hf`` over a copy in
    another dtype (`lmrl.rollout.copy.CopyEngine`), ``vllm`` (`lmrl.rollout.vllm.VLLMEngine`,
    where vLLM is installed); the wrappers `lmrl.rollout.agent.AgentLoop` (multi-turn) and
    `lmrl.workers.precision.PrecisionEngine` (the actor's autocast). Each is an
    ``lmrl.workers.roles.EngineRole``: the same methods, with the same signatures.

    Attributes:
        pad_id: the padding token of its batches.
        shares_weights: the engine generates with the actor's own module, so its log-probs
            are the actor's (the trainer may then take the old log-probs from the update's
            own forward); False for an engine with a copy of its own (vLLM).
        reports_rows: `set_row_done` takes a hook (rows are reported as they stop).
    """

    pad_id: int
    shares_weights: bool = True
    reports_rows: bool = False

    @abstractmethod
    def generate(
        self,
        prompts: Batch,
        n: int = 1,
        sampling: SamplingParams | None = None,
        *,
        prompt_offset: int = 0,
    ) -> Batch:
        """Sample ``n`` continuations of every prompt.

        Args:
            prompts: ``input_ids`` (B, P) left-padded, ``attention_mask`` (B, P) bool,
                optional ``position_ids`` (B, P), optional ``uid`` and any other columns.
            n: samples per prompt (``G``), >= 1.
            sampling: how to sample; default `SamplingParams()`.
            prompt_offset: the position of this call's first prompt in the whole batch: a
                sample's randomness depends on its prompt's position and sample index, not
                on the call, so a batch split across ranks (or calls) samples exactly what
                one call on the whole batch samples.
        Returns:
            A `Batch` of B*n rows in the layout of this module's docstring.
        """

    def close(self) -> None:  # noqa: B027  (a no-op that engines with state override)
        """Free what the engine holds of its own (a vLLM engine, tool processes); an engine
        that generates with the actor's module holds nothing."""

    @abstractmethod
    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Load weights into the engine's model, in place.

        Args:
            state_dict: the actor's weights under its names (an async run's pushed version, a
                checkpoint's ``model_state``); None = the current weights of the module the
                engine was built over (a forced sync; nothing to copy for an engine that
                generates with that module itself).

        Raises:
            RuntimeError: missing or unexpected keys (torch's message).
        """

    def set_row_done(self, hook: RowDone | None) -> None:
        """Report rows as they stop to ``hook`` (a `RowDone`) during ``generate``; None stops
        reporting. Engines with ``reports_rows`` False take only None.

        Raises:
            ValueError: a hook given to an engine that does not report rows.
        """
        if hook is not None:
            raise ValueError(f"{type(self).__name__} does not report rows as they stop")

    def view(self) -> EngineView:
        """What a caller can do with the engine's model (`EngineView`): here nothing but read
        ``shares_weights``; engines that generate with a module of this process say more."""
        return EngineView(None, shares_weights=self.shares_weights)


def check_prompts(prompts: Batch, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a prompts batch; return its ``input_ids`` and bool ``attention_mask``.

    Args:
        prompts: must hold ``input_ids`` (B, P) integer and ``attention_mask`` (B, P),
            left-padded (in each row, no valid token before a padding one), every row with at
            least one token.
        n: samples per prompt.
    Returns:
        ``input_ids`` (B, P) long, ``attention_mask`` (B, P) bool.

    Raises:
        ValueError: a missing key, a wrong shape or dtype, right padding, an empty prompt, or
            ``n`` < 1 (the message names the key or argument).
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an int >= 1, got {n!r}")
    for key in ("input_ids", "attention_mask"):
        if key not in prompts:
            raise ValueError(f"prompts batch has no {key!r}; keys: {prompts.keys()}")
    input_ids, mask = prompts["input_ids"], prompts["attention_mask"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("prompts 'input_ids' must be a (B, P) tensor")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"prompts 'input_ids' must hold integer ids, got {input_ids.dtype}")
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        raise ValueError(
            f"prompts 'attention_mask' must have the shape of 'input_ids' {tuple(input_ids.shape)}"
        )
    if input_ids.shape[0] == 0:
        raise ValueError("prompts batch is empty (B = 0)")
    if input_ids.shape[1] == 0:
        raise ValueError("prompts 'input_ids' has no columns (P = 0)")
    mask = mask.bool()
    if "position_ids" in prompts and prompts["position_ids"].shape != input_ids.shape:
        raise ValueError(
            f"prompts 'position_ids' must have the shape of 'input_ids' {tuple(input_ids.shape)}"
        )
    empty = (~mask.any(dim=1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"prompts rows {empty.tolist()} have no token (attention_mask all False)")
    # left padding: once a row's mask is True it stays True
    not_left = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1).nonzero().flatten()
    if not_left.numel():
        raise ValueError(
            f"prompts must be left-padded; rows {not_left.tolist()} of 'attention_mask' have "
            "padding after a token"
        )
    return input_ids.long(), mask


def finish_rollout(
    prompts: Batch,
    n: int,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    temperature: float,
    response_attention: torch.Tensor | None = None,
) -> Batch:
    """Assemble an engine's output `Batch` from its sampled tokens.

    Args:
        prompts: the prompts batch given to ``generate`` (B rows).
        n: samples per prompt.
        responses: (B*n, T) sampled tokens, right-padded with the pad id.
        response_mask: bool (B*n, T), True up to and including the stopping token.
        rollout_log_probs: (B*n, T) float, 0 outside ``response_mask``.
        temperature: the temperature of ``rollout_log_probs``, stored in ``meta``.
        response_attention: bool (B*n, T), the response tokens the model reads, when they
            are more than ``response_mask`` (a multi-turn rollout's observations: read, not
            trained); default ``response_mask``.
    Returns:
        The B*n-row batch described in this module's docstring: every prompt column
        repeated ``n`` times (tensors other than the prompt's own keys too), ``uid`` added
        when absent.
    """
    source = prompts
    if "uid" not in source:
        source = source.select(*source.keys())
        source["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(prompts))], dtype=object)
    rows = source.repeat_interleave(n)
    prompt_ids = rows.pop("input_ids").long()
    prompt_mask = rows.pop("attention_mask").bool()
    prompt_pos = rows.pop("position_ids", None)
    device = prompt_ids.device
    responses = responses.to(device)
    response_mask = response_mask.to(device)
    if response_attention is None:
        response_attention = response_mask
    attention_mask = torch.cat([prompt_mask, response_attention.to(device).bool()], dim=1)
    if prompt_pos is None:
        position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    else:
        prompt_pos = prompt_pos.to(device).long()
        response_pos = prompt_pos[:, -1:] + response_attention.long().cumsum(dim=1)
        position_ids = torch.cat([prompt_pos, response_pos], dim=1)
    rows["prompts"] = prompt_ids
    rows["responses"] = responses
    rows["input_ids"] = torch.cat([prompt_ids, responses], dim=1)
    rows["attention_mask"] = attention_mask
    rows["position_ids"] = position_ids
    rows["response_mask"] = response_mask
    rows["rollout_log_probs"] = rollout_log_probs.to(device)
    rows.meta["temperature"] = float(temperature)
    return rows


def default_eos_ids(model: nn.Module, tokenizer=None) -> list[int]:
    """Every id that ends a sample: the tokenizer's ``eos_token_id`` and the model's
    ``generation_config.eos_token_id`` (an int or a list), de-duplicated.

    Raises:
        ValueError: neither defines an EOS id.
    """
    ids: list[int] = []
    candidates = [getattr(tokenizer, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    candidates.append(getattr(generation_config, "eos_token_id", None))
    for c in candidates:
        for i in [c] if isinstance(c, int) else (c or []):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError(
            "no EOS token id: neither the tokenizer nor model.generation_config defines "
            "eos_token_id; pass eos_token_ids to the engine"
        )
    return ids


def stop_and_pad_ids(
    model, tokenizer, eos_token_ids: Sequence[int] | None, pad_token_id: int | None
) -> tuple[list[int], int]:
    """An engine's ``(eos ids, pad id)``: the given EOS ids or `default_eos_ids`; the given pad
    id, else the tokenizer's, else the first EOS id.

    Raises:
        ValueError: an empty list of EOS ids.
    """
    eos = (
        [int(i) for i in eos_token_ids]
        if eos_token_ids is not None
        else default_eos_ids(model, tokenizer)
    )
    if not eos:
        raise ValueError("eos_token_ids must not be empty")
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
    return eos, int(pad_token_id) if pad_token_id is not None else eos[0]


class CallSeeds:
    """The seed of each ``generate`` call: the `SamplingParams`' own, else the next draw of an
    engine-owned generator (seeded by ``seed``, or nondeterministically when None), which
    leaves the global RNG alone."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self.generator: torch.Generator | None = None

    def for_call(self, sampling: SamplingParams) -> int:
        if sampling.seed is not None:
            return sampling.seed
        if self.generator is None:
            self.generator = torch.Generator()
            if self.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.seed)
        return int(torch.randint(0, 2**62, (1,), generator=self.generator))
