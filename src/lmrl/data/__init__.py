"""Data: prompt datasets in verl's layout, the prompt sampler, the built-in tasks.

- ``lmrl.data.dataset``: ``RLDataset`` (parquet / JSONL / JSON / saved ``datasets``; chat
  template; overlong filtering or truncation; ``collate`` into a left-padded ``Batch``),
  ``read_records``, ``check_row``;
- ``lmrl.data.sampler``: ``PromptSampler`` (seeded per-epoch shuffles, exact resume);
- ``lmrl.data.sft``: ``SFTDataset`` (``lmrl sft``'s examples: token ids and a loss mask from
  prompt/response, chat-message or verl RL-format rows), ``row_segments``, ``chat_segments``;
- ``lmrl.data.tasks``: ``TASKS``, ``write_task`` (``digits``, ``arithmetic``, ``countdown``,
  ``knights_knaves``).

The names below are imported lazily (PEP 562), so ``lmrl tasks`` does not import torch.
"""

from __future__ import annotations

from lmrl._lazy import lazy_exports

_EXPORTS = {
    "RLDataset": "lmrl.data.dataset",
    "read_records": "lmrl.data.dataset",
    "check_row": "lmrl.data.dataset",
    "PromptSampler": "lmrl.data.sampler",
    "SFTDataset": "lmrl.data.sft",
    "Segment": "lmrl.data.sft",
    "chat_segments": "lmrl.data.sft",
    "row_segments": "lmrl.data.sft",
    "TASKS": "lmrl.data.tasks",
    "TaskSpec": "lmrl.data.tasks",
    "generate_rows": "lmrl.data.tasks",
    "write_task": "lmrl.data.tasks",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
