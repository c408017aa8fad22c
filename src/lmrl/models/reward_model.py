"""A learned reward model: a sequence-classification model scoring (prompt, response) pairs.

It is loaded the way verl and TRL load one, ``AutoModelForSequenceClassification`` with
``num_labels == 1``, and scores the last token of each sequence. Two input paths, as verl's:

- the same tokenizer as the policy: the rollout's own ``input_ids`` (prompt and response) go
  in as they are;
- another tokenizer (``reward_model.model.input_tokenizer`` set): prompt and response are
  decoded with the policy's tokenizer and re-encoded with the reward model's, through its chat
  template when it has one (a user turn, then the assistant's response).

The score is read at the last attended position, found from the attention mask, never from
the pad id (a tokenizer whose pad is its EOS would otherwise score the token before the EOS).
"""

from __future__ import annotations

import torch
from torch import nn

from lmrl.batch import Batch, response_tokens_mask
from lmrl.models.loading import (
    ModelError,
    check_model_path,
    load_config,
    load_tokenizer,
    resolve_dtype,
    weight_errors,
)

__all__ = ["RewardModel", "load_reward_model"]


def load_reward_model(
    path: str, dtype=None, device: str | torch.device = "cpu", trust_remote_code: bool = False
) -> nn.Module:
    """An ``AutoModelForSequenceClassification`` with one label, in eval mode, frozen.

    Raises:
        ModelError: no model at ``path``, or one that is not a one-label classifier.
    """
    from transformers import AutoModelForSequenceClassification

    path = check_model_path(path)
    config = load_config(path, trust_remote_code)
    if getattr(config, "num_labels", None) != 1:
        raise ModelError(
            f"reward_model.model.path={path!r}: a reward model must be a sequence "
            f"classifier with num_labels=1 (one score per sequence), this one has "
            f"num_labels={getattr(config, 'num_labels', None)}"
        )
    with weight_errors(path, "reward model"):
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code
        )
    model.to(device).eval().requires_grad_(False)
    return model


class RewardModel:
    """Scores of a rollout batch under a reward model.

    Args:
        model: from `load_reward_model`.
        tokenizer: the reward model's tokenizer; None = it shares the policy's token ids.
        policy_tokenizer: decodes the rollout when ``tokenizer`` is given.
        micro_batch_size: sequences per forward pass (None = all).
        max_length: keep at most this many tokens per sequence (the last ones).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        policy_tokenizer=None,
        micro_batch_size: int | None = None,
        max_length: int | None = None,
    ) -> None:
        if tokenizer is not None and policy_tokenizer is None:
            raise ValueError("re-tokenizing needs the policy's tokenizer to decode the rollout")
        self.model = model
        self.tokenizer = tokenizer
        self.policy_tokenizer = policy_tokenizer
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length

    @classmethod
    def from_config(cls, cfg, policy_tokenizer, device) -> RewardModel:
        """From the ``reward_model`` section."""
        m = cfg.model
        model = load_reward_model(m.path, device=device, trust_remote_code=m.trust_remote_code)
        tokenizer = None
        if m.input_tokenizer is not None:
            tokenizer = load_tokenizer(m.path, m.trust_remote_code)
        return cls(model, tokenizer, policy_tokenizer, cfg.micro_batch_size, cfg.max_length)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        """(B,) float32 scores of ``batch``'s (prompt, response) pairs."""
        ids, mask = self._inputs(batch)
        if self.max_length is not None and ids.shape[1] > self.max_length:
            ids, mask = ids[:, -self.max_length :], mask[:, -self.max_length :]
        size = self.micro_batch_size or max(len(ids), 1)
        device = next(self.model.parameters()).device
        scores = [
            self._score(ids[i : i + size].to(device), mask[i : i + size].to(device))
            for i in range(0, len(ids), size)
        ]
        return torch.cat(scores).float().cpu() if scores else torch.zeros(0)

    def _inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tokenizer is None:
            return batch["input_ids"], batch["attention_mask"].bool()
        dec = self.policy_tokenizer
        prompts = dec.batch_decode(batch["prompts"], skip_special_tokens=True)
        responses = [
            dec.decode(ids[m], skip_special_tokens=True)
            for ids, m in zip(batch["responses"], response_tokens_mask(batch), strict=True)
        ]
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            texts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                    tokenize=False,
                )
                for p, r in zip(prompts, responses, strict=True)
            ]
        else:
            texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        side = tok.padding_side
        tok.padding_side = "right"
        try:
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            tok.padding_side = side
        return enc["input_ids"], enc["attention_mask"].bool()

    def _score(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The classifier's output at each row's last attended position, (b,)."""
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        last = (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(-1)
        head = getattr(self.model, "score", None)
        body = getattr(self.model, getattr(self.model, "base_model_prefix", ""), None)
        if isinstance(head, nn.Module) and isinstance(body, nn.Module):
            hidden = body(input_ids=ids, attention_mask=mask.long(), position_ids=positions)
            hidden = hidden.last_hidden_state[torch.arange(len(ids)), last]  # (b, H)
            return head(hidden).squeeze(-1)
        # another architecture: its own pooling (the last non-pad token)
        out = self.model(input_ids=ids, attention_mask=mask.long())
        return out.logits.squeeze(-1)
