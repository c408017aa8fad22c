"""The ``hf`` engine: batched sampling with the KV cache on any Hugging Face causal LM.

A sampling loop written here rather than ``model.generate``, for three reasons: the
log-prob of every sampled token under the untruncated, temperature-scaled distribution comes
out of the same step that samples it (``rollout_log_probs``); the randomness is counter-based
(never the global RNG): the uniform that picks sample ``j`` of the ``i``-th prompt at decode
step ``t`` is a hash of (seed, ``i * n + j``, ``t``), so a seed reproduces a rollout exactly,
whatever the micro-batching and however the prompts are split over calls or ranks
(``prompt_offset``); and the loop is small enough to read.

One step for a (B*n, ·) batch of left-padded rows: a forward of the last tokens with the
cache, ``logits / temperature`` in float32, ``log_softmax`` (recorded at the sampled token),
top-k then top-p truncation, one categorical draw (`_draw`; argmax when greedy), then rows that
produced an EOS id or completed a stop string are marked finished and fed the pad id from
then on. The loop ends when every row has finished or after ``max_new_tokens`` steps. Row
positions continue each prompt's own (``position_ids`` of the last prompt token + 1, ...),
so a left-padded prompt gets the same continuation as alone.

Decode steps attend through `lmrl.rollout.static.decode_attention` (the query heads of a
key/value head folded into one read of the cache; two matmuls on a CPU, where sdpa's kernel is
slower at one query token), the prefill through the model's own attention.

The ``n`` samples of a prompt share its prefill: each distinct prompt of a micro-batch runs
through the model once, and its KV cache and last logits are gathered to its ``n`` rows
(``index_select``), so the prefill costs ``B`` prompts, not ``B * n``.

The engine generates with the module it was given: in-process it is the actor's own, so
every optimizer step is seen by the next rollout without copying weights.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from lmrl.batch import Batch
from lmrl.models.forward import cache_keyword, fused_head, unwrap
from lmrl.models.layout import distinct_rows
from lmrl.rollout.base import (
    CallSeeds,
    EngineView,
    RolloutEngine,
    RowDone,
    SamplingParams,
    check_prompts,
    default_eos_ids,
    finish_rollout,
    stop_and_pad_ids,
)
from lmrl.rollout.sampling import Draws, check_finite, pick, stop_hits
from lmrl.rollout.static import (
    check_decode,
    decode_attention_on,
    session_kv,
    static_sample,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["HFEngine", "default_eos_ids"]


class HFEngine(RolloutEngine):
    """Generation with a ``transformers`` causal LM and its KV cache, on CPU or GPU.

    Args:
        model: a causal LM (``AutoModelForCausalLM``, possibly PEFT-wrapped); generation runs
            on its device.
        tokenizer: its tokenizer; gives the EOS and pad ids and decodes tails for stop
            strings.
        eos_token_ids: ids that end a sample; default `default_eos_ids(model, tokenizer)`.
        pad_token_id: id written after a sample ends; default the tokenizer's pad id, else
            the first EOS id.
        micro_batch_size: generate at most this many rows (prompts x samples) at a time to
            bound the KV cache; None = all at once.
        seed: seed of the engine's own generator, used by calls whose `SamplingParams` has no
            seed; None draws a random one.
        decode: ``auto`` (CUDA graphs on CUDA, today's loop elsewhere), ``graphs``, ``static``
            (preallocated cache, eager) or ``dynamic`` (today's loop); `lmrl.rollout.static`.
        check_every: decode steps between host checks that every row has finished (static).

    Rows are reported as they stop (EOS, a stop string, the length limit) to the hook of
    `set_row_done` (the trainer scores them while the other rows decode:
    ``reward.overlap.rows``): row by row in the dynamic decode; a micro-batch at a time in
    the static and graphs decodes.
    """

    reports_rows = True

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        micro_batch_size: int | None = None,
        seed: int | None = None,
        decode: str = "auto",
        check_every: int = 16,
    ) -> None:
        check_decode(decode)  # the device is known at each call, and resolved there
        self.decode, self.check_every = decode, check_every
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids, self.pad_id = stop_and_pad_ids(model, tokenizer, eos_token_ids, pad_token_id)
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.seeds = CallSeeds(seed)
        params = inspect.signature(model.forward).parameters
        takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
        # only the last position's logits are needed: never build (B, P, V) at prefill
        self._logits_to_keep = "logits_to_keep" in params or takes_kwargs
        self._cache_keyword = cache_keyword(model)
        self._row_done: RowDone | None = None

    # ------------------------------------------------------------------ interface
    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy ``state_dict`` into the engine's model in place (see `RolloutEngine`); None
        copies nothing: the engine generates with the module it was built over.

        Raises:
            RuntimeError: missing or unexpected keys (torch's message).
        """
        if state_dict is None:
            return
        with torch.no_grad():
            self.model.load_state_dict(dict(state_dict), strict=True)

    def set_row_done(self, hook: RowDone | None) -> None:
        """Report rows as they stop to ``hook`` (see `RolloutEngine.set_row_done`)."""
        self._row_done = hook

    def view(self) -> EngineView:
        """Its model, in its parameters' dtype (see `RolloutEngine.view`)."""
        dtype = next(self.model.parameters()).dtype
        return EngineView(self.model, compute=dtype, shares_weights=self.shares_weights)

    def generate(
        self,
        prompts: Batch,
        n: int = 1,
        sampling: SamplingParams | None = None,
        *,
        prompt_offset: int = 0,
    ) -> Batch:
        """Sample ``n`` continuations per prompt; see `RolloutEngine.generate`.

        The model is put in eval mode for the call and every module's train/eval flag is
        restored afterwards. The returned tensors are ordinary (not inference-mode) tensors on
        the prompts' device.

        Raises:
            DivergedError: the model's logits were not finite (NaN/inf) at a sampled token.
        """
        sampling = sampling or SamplingParams()
        input_ids, mask = check_prompts(prompts, n)
        if self.tokenizer is None and sampling.stop:
            raise ValueError("stop strings need the engine's tokenizer (tokenizer=None given)")
        seed = self.seeds.for_call(sampling)
        device = self._device()
        position_ids = prompts.get("position_ids")
        rows = torch.arange(len(prompts)).repeat_interleave(n)
        # each row's key of the counter-based draws: its sample's place in the whole batch
        keys = (prompt_offset * n + torch.arange(len(rows))).to(device)
        size = self.micro_batch_size or max(len(rows), 1)
        flags = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            pieces = []
            with torch.inference_mode():
                for start in range(0, len(rows), size):
                    r = rows[start : start + size]
                    pos = position_ids[r].to(device) if position_ids is not None else None
                    first, inverse = distinct_rows(r)
                    ids, m = input_ids[r].to(device), mask[r].to(device)
                    shared = (first.to(device), inverse.to(device))
                    draws = Draws(seed, keys[start : start + size])
                    done = self._reporter(prompts, n, sampling, start)
                    pieces.append(self._sample(ids, m, pos, sampling, draws, *shared, done))
        finally:
            for module, training in flags.items():
                module.training = training
        width = max((p[0].shape[1] for p in pieces), default=0)
        responses = torch.cat([_pad_right(p[0], width, self.pad_id) for p in pieces])
        response_mask = torch.cat([_pad_right(p[1], width, False) for p in pieces])
        log_probs = torch.cat([_pad_right(p[2], width, 0.0) for p in pieces])
        check_finite(log_probs)  # diverged weights: one line, not an indexing traceback
        # clone outside inference mode: the trainer feeds these to autograd later
        return finish_rollout(
            prompts,
            n,
            responses.clone(),
            response_mask.clone(),
            log_probs.clone(),
            sampling.logprob_temperature,
        )

    def _reporter(self, prompts: Batch, n: int, sampling: SamplingParams, start: int):
        """`_sample`'s ``row_done`` for the micro-batch whose first row is the call's row
        ``start``: its rows' tokens made into a block (`finish_rollout`) for the hook of
        `set_row_done`."""
        hook = self._row_done
        if hook is None:
            return None

        def done(rows: torch.Tensor, responses, response_mask, log_probs) -> None:
            rows = rows + start
            block = finish_rollout(prompts.index(rows // n), 1, responses, response_mask,
                                   log_probs, sampling.logprob_temperature)  # fmt: skip
            hook(rows, block)

        return done

    def open_session(
        self,
        prompts: Batch,
        n: int,
        sampling: SamplingParams,
        *,
        prompt_offset: int = 0,
        rows: torch.Tensor | None = None,
    ) -> HFSession:
        """A multi-turn session over the ``B * n`` sample rows of ``prompts`` (or the subset
        ``rows`` of them) that keeps their KV cache between turns (`HFSession`)."""
        input_ids, mask = check_prompts(prompts, n)
        all_rows = torch.arange(len(prompts)).repeat_interleave(n)
        keys = prompt_offset * n + torch.arange(len(all_rows))
        if rows is not None:
            all_rows, keys = all_rows[rows], keys[rows]
        position_ids = prompts.get("position_ids")
        pos = position_ids[all_rows] if position_ids is not None else None
        return HFSession(
            self,
            input_ids[all_rows],
            mask[all_rows],
            pos,
            sampling,
            self.seeds.for_call(sampling),
            keys,
        )

    # ------------------------------------------------------------------ internals
    def _device(self) -> torch.device:
        first = next(self.model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    def _forward(self, ids, attention_mask, position_ids, cache) -> torch.Tensor:
        """Logits (B, V) at the last position, in float32, updating ``cache`` in place.

        On a CPU a plain output head (`lmrl.models.forward.fused_head`) runs as ``W @ h.T``:
        MKL's ``h @ W.T`` repacks the whole (V, H) weight every call, which made the head of a
        32k-token vocabulary 18 ms a decode step of 32 rows instead of 14.5."""
        head = _cpu_head(self.model) if ids.device.type == "cpu" else None
        if head is not None:
            backbone, lm_head = head
            out = backbone(
                input_ids=ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{cache_keyword(backbone): cache},
            )
            last = out.last_hidden_state[:, -1]  # (B, H)
            logits = (lm_head.weight @ last.to(lm_head.weight.dtype).t()).t()
            if lm_head.bias is not None:
                logits = logits + lm_head.bias
            return logits.float().contiguous()
        kwargs = {"logits_to_keep": 1} if self._logits_to_keep else {}
        out = self.model(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_keyword: cache},
            **kwargs,
        )
        return out.logits[:, -1, :].float()

    def _sample(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        sampling: SamplingParams,
        draws: Draws,
        first: torch.Tensor | None = None,
        inverse: torch.Tensor | None = None,
        row_done: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sampling loop for one micro-batch of left-padded rows.

        Args:
            input_ids: (R, P) long, left-padded.
            mask: (R, P) bool.
            position_ids: (R, P) or None (then ``cumsum(mask) - 1``, clipped at 0).
            first, inverse: rows sharing a prompt: ``first`` (U,) one row of each distinct
                prompt, ``inverse`` (R,) each row's distinct prompt; the prefill runs the U
                rows only. None = every row is prefilled.
            row_done: called as ``row_done(rows, responses, response_mask, log_probs)``
                with the micro-batch's rows (k,) that stopped and their tokens (k, t).
        Returns:
            ``responses`` (R, T) right-padded with the pad id, ``response_mask`` bool (R, T),
            ``log_probs`` (R, T) float32 0 outside the mask; T = steps run.
        """
        from transformers import DynamicCache

        rows, prompt_len = input_ids.shape
        device = input_ids.device
        max_new = sampling.max_new_tokens
        if position_ids is None:
            position_ids = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
        out = static_sample(self, input_ids, mask, position_ids, sampling, draws, first, inverse)
        if out is not None:
            if row_done is not None:
                row_done(torch.arange(rows), *out)
            return out
        next_pos = position_ids[:, -1] + 1  # (R,)
        # the mask grows by one always-valid column per step; finished rows' outputs are unused
        full_mask = torch.ones(rows, prompt_len + max_new, dtype=torch.long, device=device)
        full_mask[:, :prompt_len] = mask.long()
        responses = torch.full((rows, max_new), self.pad_id, dtype=torch.long, device=device)
        response_mask = torch.zeros(rows, max_new, dtype=torch.bool, device=device)
        log_probs = torch.zeros(rows, max_new, dtype=torch.float32, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        left = rows  # rows not reported to row_done yet
        eos = torch.tensor([] if sampling.ignore_eos else self.eos_ids, dtype=torch.long)
        eos = eos.to(device)
        stop_width = max((len(s) for s in sampling.stop), default=0) + 1

        # a causal LM (or PEFT over one, which forwards ``config``): its Hugging Face config
        cache = DynamicCache(config=cast("PretrainedConfig", self.model.config))
        logits = self._prefill(
            input_ids, full_mask[:, :prompt_len], position_ids, cache, first, inverse
        )
        steps = 0
        with decode_attention_on(self.model):  # every forward below is a decode step
            for t in range(max_new):
                token, token_logp = pick(logits, sampling, draws, t)
                alive = ~finished
                token = token.masked_fill(finished, self.pad_id)
                responses[:, t] = token
                response_mask[:, t] = alive
                log_probs[:, t] = token_logp.masked_fill(finished, 0.0)
                # a row whose logits are not finite stops here (the call then raises)
                finished = finished | torch.isin(token, eos) | ~torch.isfinite(token_logp)
                if sampling.stop:
                    ends = torch.full((rows,), t + 1, dtype=torch.long, device=device)
                    finished = finished | stop_hits(
                        self.tokenizer, responses, ends, alive, sampling.stop, stop_width
                    )
                steps = t + 1
                if row_done is not None:  # the rows that stopped now, or all left at the limit
                    idx = (alive if steps == max_new else finished & alive).nonzero().flatten()
                    if len(idx):
                        row_done(idx.cpu(), responses[idx, :steps], response_mask[idx, :steps],
                                 log_probs[idx, :steps])  # fmt: skip
                    left -= len(idx)  # the step's one host sync is the nonzero's, not a second
                    if left == 0:
                        break
                elif steps == max_new or bool(finished.all()):
                    break
                logits = self._forward(
                    token[:, None],
                    full_mask[:, : prompt_len + t + 1],
                    (next_pos + t)[:, None],
                    cache,
                )
        return responses[:, :steps], response_mask[:, :steps], log_probs[:, :steps]

    def _prefill(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache,
        first: torch.Tensor | None,
        inverse: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run the prompts into ``cache``; their last logits (R, V). With ``first``/``inverse``
        (rows sharing a prompt, `distinct_rows`) each distinct prompt runs once and its cache
        and logits are gathered to its rows."""
        if first is not None and len(first) < input_ids.shape[0]:
            logits = self._forward(input_ids[first], mask[first], position_ids[first], cache)
            cache.reorder_cache(inverse)  # (U, ...) -> (R, ...)
            return logits[inverse]
        return self._forward(input_ids, mask, position_ids, cache)


class HFSession:
    """Multi-turn generation over R rows that keeps their KV cache from turn to turn.

    The agent loop (`lmrl.rollout.agent`) alternates `generate` (the given rows sample until
    EOS, a stop string or their token budget) and `append` (observation tokens go into the
    cache with one forward). Nothing is prefilled twice: the cache holds every row's prompt and
    everything since. Rows advance apart, so a step feeds every row one column and the rows
    with nothing to feed get a pad there with attention 0 (an interior gap in the cache that
    no query attends); each row's positions count only its real tokens, so they equal the
    positions of the compact ``cat(prompt, responses)`` the trainer later scores, and the
    recorded log-probs are the ones its forward gives.

    A row's last sampled token is fed lazily: at its next decode step, or as the first column
    of its observation block, so a turn's final token costs no forward of its own.

    The uniform behind a row's ``k``-th sampled token is `Draws` at (its key, ``k``), so a
    row's samples do not depend on which other rows share its session.
    """

    def __init__(
        self,
        engine: HFEngine,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        sampling: SamplingParams,
        seed: int,
        keys: torch.Tensor,
    ) -> None:
        from transformers import DynamicCache

        self.engine, self.sampling = engine, sampling
        device = engine._device()
        model = engine.model
        self._flags = {m: m.training for m in model.modules()}
        model.eval()
        self.rows = input_ids.shape[0]
        input_ids, mask = input_ids.to(device), mask.to(device)
        if position_ids is None:
            position_ids = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
        position_ids = position_ids.to(device).long()
        self.device = device
        self.draws = Draws(seed, keys.to(device))
        # a causal LM (or PEFT over one, which forwards ``config``): its Hugging Face config
        self.cache: DynamicCache | None = DynamicCache(
            config=cast("PretrainedConfig", model.config)
        )
        self.attn = mask.long()
        self.next_pos = position_ids[:, -1] + 1
        self.pending = torch.full((self.rows,), engine.pad_id, dtype=torch.long, device=device)
        self.has_pending = torch.zeros(self.rows, dtype=torch.bool, device=device)
        self.count = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.eos = torch.tensor(engine.eos_ids, dtype=torch.long, device=device)
        with torch.inference_mode():
            self.last_logits = engine._prefill(
                input_ids, self.attn, position_ids, self.cache, *distinct_rows(input_ids)
            )
        self.kv = session_kv(engine, self.cache, self.attn)  # None: DynamicCache

    def close(self) -> None:
        """Free the cache and restore the model's train/eval flags."""
        for module, training in self._flags.items():
            module.training = training
        self.cache = self.kv = None

    def _feed(self, ids: torch.Tensor, valid: torch.Tensor) -> None:
        """Run (R, W) left-padded ``ids`` (``valid`` marks real ones) through the cache; rows
        with a real token take the last column's logits and advance their positions."""
        positions = (self.next_pos[:, None] + valid.long().cumsum(dim=1) - 1).clamp(min=0)
        with decode_attention_on(self.engine.model):  # folds one-column feeds only
            if self.kv is not None:
                logits = self.kv.feed(ids, valid, positions)
            else:
                self.attn = torch.cat([self.attn, valid.long()], dim=1)
                logits = self.engine._forward(ids, self.attn, positions, self.cache)
        fed = valid.any(dim=1)
        self.last_logits = torch.where(fed[:, None], logits, self.last_logits)
        self.next_pos = self.next_pos + valid.long().sum(dim=1)

    def generate(
        self, rows: torch.Tensor, stop: Sequence[str], budget: torch.Tensor
    ) -> list[tuple[list[int], list[float], str]]:
        """Sample the ``rows`` (bool (R,)) until each ends: ``"eos"``, ``"stop"`` (its turn's
        text holds a stop string) or ``"length"`` (``budget`` (R,) tokens this turn).

        Returns:
            For every row (empty for rows not asked): this turn's tokens, their log-probs
            (temperature-scaled, untruncated, as ``rollout_log_probs``), and why it ended.
        """
        engine, device = self.engine, self.device
        budget = budget.to(device)
        running = rows.to(device).bool() & (budget > 0)
        width = int(budget.max()) if bool(running.any()) else 0
        # this turn's tokens and log-probs, row r's first produced[r] of them filled
        turn = torch.full((self.rows, width), engine.pad_id, dtype=torch.long, device=device)
        turn_logp = torch.zeros(self.rows, width, dtype=torch.float32, device=device)
        produced = torch.zeros(self.rows, dtype=torch.long, device=device)
        reason = torch.zeros(self.rows, dtype=torch.long, device=device)  # index of _REASONS
        stop_width = max((len(s) for s in stop), default=0) + 1
        with torch.inference_mode():
            while bool(running.any()):
                feed = running & self.has_pending
                if bool(feed.any()):
                    ids = torch.where(feed, self.pending, engine.pad_id)[:, None]
                    self._feed(ids, feed[:, None])
                    self.has_pending &= ~feed
                token, token_logp = pick(self.last_logits, self.sampling, self.draws, self.count)
                idx = running.nonzero().flatten()
                at = produced[idx]
                turn[idx, at] = token[idx]
                turn_logp[idx, at] = token_logp[idx]
                self.pending = torch.where(running, token, self.pending)
                self.has_pending |= running
                self.count += running.long()
                produced += running.long()
                ended_eos = running & torch.isin(token, self.eos)
                ended_stop = torch.zeros_like(running)
                if stop:
                    ended_stop = stop_hits(
                        engine.tokenizer, turn, produced, running & ~ended_eos, stop, stop_width
                    )
                ended_len = running & ~ended_eos & ~ended_stop & (produced >= budget)
                reason = torch.where(ended_eos, 1, torch.where(ended_stop, 2, reason))
                reason = torch.where(ended_len, 3, reason)
                running &= ~(ended_eos | ended_stop | ended_len | ~torch.isfinite(token_logp))
        check_finite(turn_logp)  # diverged weights: one line, not an indexing traceback
        lengths, reasons = produced.tolist(), reason.tolist()
        tokens, log_probs = turn.tolist(), turn_logp.tolist()
        return [
            (tokens[r][: lengths[r]], log_probs[r][: lengths[r]], _REASONS[reasons[r]])
            for r in range(self.rows)
        ]

    def append(self, observations: Mapping[int, Sequence[int]]) -> None:
        """Feed each given row its pending token and then its observation tokens, one forward
        for all rows (left-padded to the longest block)."""
        blocks = {}
        for r, obs in observations.items():
            head = [int(self.pending[r])] if bool(self.has_pending[r]) else []
            blocks[r] = head + [int(t) for t in obs]
        blocks = {r: b for r, b in blocks.items() if b}
        if not blocks:
            return
        width = max(len(b) for b in blocks.values())
        ids = torch.full((self.rows, width), self.engine.pad_id, dtype=torch.long)
        valid = torch.zeros(self.rows, width, dtype=torch.bool)
        for r, block in blocks.items():
            ids[r, width - len(block) :] = torch.tensor(block, dtype=torch.long)
            valid[r, width - len(block) :] = True
        with torch.inference_mode():
            self._feed(ids.to(self.device), valid.to(self.device))
        done = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
        done[list(blocks)] = True
        self.has_pending &= ~done


def _cpu_head(model: nn.Module):
    """``(backbone, lm_head)`` when the logits are the plain head's over the backbone
    (`fused_head`) and no forward hook of the model would be skipped by calling the two
    directly; else None (the model's own forward runs)."""
    inner = unwrap(model)
    if any(m._forward_hooks or m._forward_pre_hooks for m in {model, inner}):
        return None
    return fused_head(model)


_REASONS = ("", "eos", "stop", "length")  # why a session row's turn ended, by code


def _pad_right(x: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad (R, T) to (R, width) with ``value``."""
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)
