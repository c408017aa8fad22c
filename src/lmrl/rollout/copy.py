"""The ``hf`` engine over a copy of the actor's weights in another dtype (``rollout.dtype``).

The seeds' picture of a production step (seed ``002`` §3.6): the rollout generates in BF16,
the trainer recomputes the old log-probs in FP32 as the anchor, and the log-prob modes
(decoupled, bypass, rollout correction) exist because the two differ. vLLM gives that gap on
a GPU; `CopyEngine` gives the same gap to the ``hf`` engine anywhere, this CPU included: it
holds a copy of the actor cast to ``dtype`` and generates with it.

The copy is refreshed exactly as the vLLM engine's weights are: before a call, when the
actor's weights changed since the last copy (the trainer's explicit weights version, and
torch's per-tensor write counters for changes made outside it, such as a checkpoint load),
every tensor is copied over in place and cast. LoRA is merged into the copy's base weights
through the model's own structure: the copy is a deep copy of the (possibly PEFT-wrapped)
module, so ``load_state_dict`` of the actor's state refreshes adapters and base alike.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn

from lmrl.batch import Batch
from lmrl.models.loading import resolve_dtype, weights_version
from lmrl.rollout.base import EngineView, RolloutEngine, RowDone, SamplingParams
from lmrl.rollout.hf import HFEngine

__all__ = ["CopyEngine"]


class CopyEngine(RolloutEngine):
    """Generation with a ``dtype`` copy of ``model``, synced from it whenever it changed.

    Args:
        model: the actor's causal LM (the source of the weights; never written).
        tokenizer: its tokenizer.
        dtype: the copy's dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
        follow: sync before a call whenever the actor's weights changed (the synchronous
            step); False = only when ``sync_weights`` is called (an async run hands each
            weights version over itself, between requests).
        **options: `HFEngine`'s keyword arguments (``seed``, ``micro_batch_size``, ...).

    Attributes:
        sync_count: copies made (the first at construction).
        inner: the `HFEngine` over the copy; what else an engine is read for (``tokenizer``,
            ``eos_ids``, ``pad_id``, ``seeds``, ``micro_batch_size``) is its.
    """

    shares_weights = False

    def __init__(
        self, model: nn.Module, tokenizer=None, *, dtype: str, follow: bool = True, **options
    ) -> None:
        device = next(model.parameters()).device
        self.dtype = resolve_dtype(dtype, device)
        self.source = model
        self.follow = follow
        with torch.no_grad():
            self.copy = copy.deepcopy(model).to(self.dtype).eval()
        for p in self.copy.parameters():
            p.requires_grad_(False)
        self.inner = HFEngine(self.copy, tokenizer, **options)
        self.pad_id = self.inner.pad_id
        self.reports_rows = self.inner.reports_rows
        self.sync_count = 1
        self._synced = self._versions()

    def __getattr__(self, name: str):
        # what the agent loop reads of an engine (tokenizer, eos_ids, pad_id, seeds,
        # micro_batch_size) is the inner engine's
        if name == "inner":  # not set yet (during __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def set_row_done(self, hook: RowDone | None) -> None:
        """Rows reported as they stop (`HFEngine.set_row_done`)."""
        self.inner.set_row_done(hook)

    def view(self) -> EngineView:
        """The copy, in its dtype, and a forced sync from the actor (``sync_weights()``)."""
        return EngineView(self.copy, compute=self.dtype, shares_weights=False,
                          sync=self.sync_weights)  # fmt: skip

    def _versions(self) -> tuple[int, ...]:
        return (weights_version(self.source), *(p._version for p in self.source.parameters()))

    def _sync_if_changed(self) -> None:
        if self.follow and self._versions() != self._synced:
            self.sync_weights()

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy ``state_dict`` (the actor's names), or the actor's current weights, into the
        copy, cast to its dtype. A tied weight may be left out when its twin is there (a
        checkpoint's ``model_state`` holds ``lm_head.weight`` once, as the embedding).

        Raises:
            RuntimeError: missing or unexpected keys.
        """
        with torch.no_grad():
            if state_dict is None:
                state_dict = self.source.state_dict()  # never sharded: fsdp2 is refused
            result = self.copy.load_state_dict(state_dict, strict=False)
        missing = [k for k in result.missing_keys if not self._twin_in(k, state_dict)]
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"weights for the rollout copy: missing {missing}, "
                f"unexpected {result.unexpected_keys}"
            )
        self._synced = self._versions()
        self.sync_count += 1

    def _twin_in(self, key: str, state_dict: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``key`` is a tied weight whose twin is in ``state_dict``."""
        tensors = self.copy.state_dict(keep_vars=True)
        ptr = tensors[key].data_ptr()
        return any(k in state_dict for k, t in tensors.items() if k != key and t.data_ptr() == ptr)

    def generate(
        self,
        prompts: Batch,
        n: int = 1,
        sampling: SamplingParams | None = None,
        *,
        prompt_offset: int = 0,
    ) -> Batch:
        """Sample with the copy; see `RolloutEngine.generate`."""
        self._sync_if_changed()
        return self.inner.generate(prompts, n, sampling, prompt_offset=prompt_offset)

    def open_session(self, prompts: Batch, n: int, sampling: SamplingParams, **kwargs):
        """A multi-turn session on the copy (`HFEngine.open_session`)."""
        self._sync_if_changed()
        return self.inner.open_session(prompts, n, sampling, **kwargs)
