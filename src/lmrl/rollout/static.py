"""The ``hf`` engine's decode with a preallocated KV cache, captured as one CUDA graph per step.

Today's loop (`HFEngine._sample`) grows a ``DynamicCache`` by concatenation and syncs the host
every step; on a GPU it is bound by Python and kernel launches. Here one micro-batch of R rows
decodes into buffers sized once, so every step has the same shapes and reads and writes the
same memory, and on CUDA the whole step (the model's forward of the fed tokens, ``pick``'s
log-softmax, truncation and counter-based draw, the bookkeeping of EOS and of the outputs) is
captured once with ``torch.cuda.CUDAGraph`` and replayed: one graph launch per token.

- Prefill stays as today's: the U distinct prompts run once into a ``DynamicCache``; each
  layer's (U, H, P, D) keys and values are gathered to the R rows of a static
  (R, H, P + T - 1, D) buffer (rounded up to 8 columns), and the cache's layers are swapped for ``_StaticLayer``s, which
  writes each step's (R, H, 1, D) at the column held by a device tensor.
- The mask is a 4D additive (R, 1, 1, P + T - 1) tensor in the cache's dtype (0 = attend,
  the dtype's minimum = not), opened one column per step in place; ``transformers`` takes a 4D
  mask as it is, so no mask is built inside the step. Positions, the column and the step
  counter of the draws (`Draws`, a hash of seed, row and step) are device tensors that the
  step advances in place.
- A step attends to the cache's first columns only, rounded up to a bucket of `BUCKET`
  columns (the keys, values and mask are views of that width), and one graph is captured per
  bucket: the cache read grows with the rows' length instead of being the full P + T - 1
  every step.
- Attention of the one fed token folds the query heads that share a key/value head into the
  query length, (R, H_kv, H / H_kv, D) against the (R, H_kv, W, D) cache (`decode_attention`,
  registered with ``transformers`` and switched on for the steps only), so grouped-query
  models read their cache once instead of copying it to every query head (``repeat_kv``).
- Where `FUSED_NORM` is on, the steps' RMSNorms of the tested model types run as
  ``F.rms_norm`` times the weight (`fused_norms_on`): on CUDA one fused kernel and a product
  instead of transformers' eight elementwise and reduction kernels (casts, square, mean, eps,
  rsqrt, products), the same fp32 normalization rounded to the input's dtype. Off by default
  until measured on a GPU (``benchmarks/gpu_decode.py --modes graphs,graphs-fusednorm``).
- The host looks at ``finished`` only every ``check_every`` steps (each step when stop
  strings are set: their check decodes text on the host anyway); steps run past the last
  finish write pad / mask False / log-prob 0, exactly the padding today's loop returns, and
  the outputs are cut to the longest response.

Under autocast over fp32 weights (the trainer's mixed precision, `PrecisionEngine`) the
graphs read the autocast cache's bf16 copies of the weights, cast by the eager warm-up step:
the cache lives as long as the generate call's autocast, which encloses every capture and
replay, and the weights do not change within a call.

The same step function runs eagerly (any device) or replayed from a graph (CUDA), so the CPU
tests of the eager static path against today's loop and the GPU tests of graph against eager
cover the whole. Models whose cache is not plain full-attention ``DynamicLayer``s (sliding
windows, linear attention) or whose attention takes no 4D additive mask (flash attention)
keep today's loop.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING

import torch

from lmrl.models.packing import LLAMA_FAMILY
from lmrl.rollout.base import SamplingParams
from lmrl.rollout.sampling import pick, stop_hits

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # what torch.cuda.graph_pool_handle() returns
    from transformers.cache_utils import DynamicLayer

log = logging.getLogger(__name__)

DECODE_MODES = ("auto", "graphs", "static", "dynamic")
BUCKET = 128  # a decode step attends to the cache's first columns rounded up to this many
FOLD_GQA = True  # decode steps use `decode_attention` (off: the model's own, for benchmarks)
ATTENTION = "lmrl_decode"  # its name in transformers' AttentionInterface
MATMUL_DEVICES = ("cpu",)  # where `decode_attention` is two matmuls instead of sdpa's kernel
FUSED_NORM = False  # decode steps normalize through `F.rms_norm` (`fused_norms_on`)
_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it is given in this process."""
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


def check_decode(mode: str) -> None:
    """Refuse a ``rollout.hf.decode`` that is not one of `DECODE_MODES`."""
    if mode not in DECODE_MODES:
        raise ValueError(f"rollout.hf.decode must be one of {DECODE_MODES}, got {mode!r}")


def resolve_decode(mode: str, device: torch.device) -> str:
    """The decode path ``mode`` gives on ``device``: ``graphs`` (static cache and CUDA graphs),
    ``static`` (static cache, eager) or ``dynamic`` (today's loop). ``auto`` = ``graphs`` on
    CUDA (on an H200 at the Qwen2.5-0.5B shape, 256 rows x 512 tokens: 2.8 s against 34 s for
    today's loop; docs/performance.md) and ``dynamic`` elsewhere (on a CPU the static path's
    fixed costs outweigh what it saves for small models). ``graphs`` asked off CUDA falls
    back to ``dynamic`` and says so once."""
    check_decode(mode)
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "dynamic"
    if mode == "graphs" and device.type != "cuda":
        warn_once(f"rollout.hf.decode=graphs needs CUDA; decoding on {device} with today's loop")
        return "dynamic"
    return mode


def static_supported(model) -> str | None:
    """None when the static path can run ``model``, else why not."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        return f"attention {impl!r} takes no 4D additive mask"
    types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer types {sorted(types)} (only full attention has a static cache here)"
    return None


def decode_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention of one query token per row against the cache (static, or the dynamic loop's),
    as ``transformers`` calls an attention function: ``query`` (R, H, 1, D), ``key``/``value``
    (R, H_kv, W, D), ``attention_mask`` (R, 1, 1, W) additive, boolean or None. The G = H / H_kv
    query heads of a key/value head (adjacent, as ``repeat_kv`` orders them) become G query
    positions of that head, so the cache is read once and never copied; on `MATMUL_DEVICES`
    (the CPU) as two matmuls (`_matmul_attention`), elsewhere through sdpa. Returns
    ((R, 1, H, D), None). Any other forward the model runs meanwhile (several tokens: never a
    decode step) goes to transformers' own sdpa attention."""
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    matmul = query.device.type in MATMUL_DEVICES
    if length != 1 or (heads == kv_heads and not matmul):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    folded = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    # (R, H_kv, G, D): every query head of a group at the same cache columns and mask
    if matmul:
        out = _matmul_attention(folded, key, value, attention_mask, scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            folded, key, value, attn_mask=attention_mask, scale=scaling
        )
    return out.reshape(rows, 1, heads, dim), None


def _matmul_attention(query, key, value, mask, scaling):
    """Attention as two matmuls and a float32 softmax, for a CPU: ``query`` (R, H_kv, G, D)
    against ``key``/``value`` (R, H_kv, W, D), ``mask`` (R, 1, 1, W) boolean (True = attend),
    additive, or None. sdpa's CPU kernel is slower at a decode step's shapes: the tiny
    benchmark model's generate (64 rows, 4 heads over 2, ~40 columns) took 53.5 ms a call
    with it and 47 ms with this."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    return torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)


@functools.cache
def _registered() -> str:
    """Register `decode_attention` under `ATTENTION`, its masks built as sdpa's are (decode
    steps pass their own 4D mask, which transformers takes as it is)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return ATTENTION


@contextlib.contextmanager
def decode_attention_on(model):
    """Within: ``model``'s attention layers call `decode_attention` (its config's
    ``_attn_implementation``, restored on exit). A model without a config is left alone.
    Another thread's forward of the same module meanwhile still computes its attention right
    (sdpa's masks and sdpa's attention), only through this function."""
    config = getattr(getattr(model, "module", model), "config", None)
    if config is None or not FOLD_GQA:
        yield
        return
    before = config._attn_implementation
    config._attn_implementation = _registered()
    try:
        yield
    finally:
        config._attn_implementation = before


def _fused_rms_norm(module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``module`` (a Llama-style RMSNorm) of ``hidden_states`` (..., H) through `F.rms_norm`:
    normalized in fp32, rounded to the input's dtype, times the weight, as transformers does."""
    normed = torch.nn.functional.rms_norm(
        hidden_states, (hidden_states.shape[-1],), eps=module.variance_epsilon
    )
    return module.weight * normed.to(hidden_states.dtype)


@contextlib.contextmanager
def fused_norms_on(model):
    """Within, where `FUSED_NORM` is on and ``model`` is of `LLAMA_FAMILY` (whose RMSNorm is
    `_fused_rms_norm`'s; Gemma's 1 + weight is not): its RMSNorm modules compute through
    `_fused_rms_norm` (their class's forward again on exit)."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    if not FUSED_NORM or getattr(config, "model_type", None) not in LLAMA_FAMILY:
        yield
        return
    norms = [
        m
        for m in inner.modules()
        if type(m).__name__.endswith("RMSNorm")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and isinstance(getattr(m, "variance_epsilon", None), float)
        and "forward" not in vars(m)
    ]
    for m in norms:
        m.forward = functools.partial(_fused_rms_norm, m)
    try:
        yield
    finally:
        for m in norms:
            del m.forward


def _dynamic_layer() -> type[DynamicLayer]:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


@functools.cache
def _static_layer_class():
    """`_StaticLayer`, made on first use so that importing lmrl imports no ``transformers``."""

    class _StaticLayer(_dynamic_layer()):
        """One layer's preallocated keys and values (R, H, L, D); `update` writes the step's
        columns at ``col`` (a (W,) device tensor) in place and returns the buffers' first
        ``width`` columns (views; all of them when ``width`` is None)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, col: torch.Tensor) -> None:
            super().__init__()
            self.keys, self.values, self.col = keys, values, col
            self.width: int | None = None
            self.is_initialized = True
            self.device = keys.device

        def update(self, key_states, value_states, *args, **kwargs):
            # in the buffers' dtypes, as the prefill's cache stored them: under autocast some
            # transformers releases keep values in the (fp32, after rotary) keys' dtype
            self.keys.index_copy_(2, self.col, key_states.to(self.keys.dtype))
            self.values.index_copy_(2, self.col, value_states.to(self.values.dtype))
            if self.width is None:
                return self.keys, self.values
            return self.keys[:, :, : self.width], self.values[:, :, : self.width]

    return _StaticLayer


class StaticDecode:
    """The decode of one micro-batch of R left-padded rows on static buffers.

    Args:
        engine: the `HFEngine` (its model, ``_forward``, pad and EOS ids, tokenizer).
        input_ids: (R, P) long, left-padded; ``mask`` (R, P) bool; ``position_ids`` (R, P).
        sampling: the call's sampling; ``draws`` its `Draws` over the R rows.
        first, inverse: rows sharing a prompt (`distinct_rows`), or None.
        graphs: capture the step as a CUDA graph (CUDA only; on failure, eager and a warning).
        check_every: steps between host checks of "every row finished" (no stop strings).
    """

    def __init__(
        self,
        engine,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        sampling: SamplingParams,
        draws,
        first: torch.Tensor | None,
        inverse: torch.Tensor | None,
        *,
        graphs: bool,
        check_every: int,
    ) -> None:
        from transformers import DynamicCache

        self.engine, self.sampling, self.draws = engine, sampling, draws
        self.graphs, self.check_every = graphs, max(1, check_every)
        self._pool: _POOL_HANDLE | None = None  # the graphs' memory pool, made at first capture
        rows, prompt_len = input_ids.shape
        device = input_ids.device
        max_new = sampling.max_new_tokens
        self.rows, self.max_new = rows, max_new
        cache = DynamicCache(config=engine.model.config)
        if first is not None and len(first) < rows:  # each distinct prompt prefilled once
            logits = engine._forward(
                input_ids[first], mask[first].long(), position_ids[first], cache
            )
            logits, gather = logits[inverse], inverse
        else:
            logits, gather = engine._forward(input_ids, mask.long(), position_ids, cache), None
        layer_cls = _dynamic_layer()
        if not cache.layers or any(type(layer) is not layer_cls for layer in cache.layers):
            raise NotImplementedError("the model's cache is not plain DynamicLayers")
        length = prompt_len + max(max_new - 1, 0)  # the last token is never fed
        length = -(-length // 8) * 8  # a multiple of 8: sdpa's fused kernels want aligned masks
        self.prompt_len, self.length, self.width = prompt_len, length, length
        self.col = torch.full((1,), prompt_len, dtype=torch.long, device=device)
        self.layers = []  # the cache's static layers
        for i, layer in enumerate(cache.layers):
            # a plain DynamicLayer (checked above) the prefill filled
            assert isinstance(layer, layer_cls) and layer.keys is not None
            assert layer.values is not None
            k, v = layer.keys, layer.values  # (U, H, P, D)
            if gather is not None:
                k, v = k.index_select(0, gather), v.index_select(0, gather)
            keys = k.new_zeros(rows, k.shape[1], length, k.shape[3])
            values = v.new_zeros(rows, v.shape[1], length, v.shape[3])
            keys[:, :, :prompt_len] = k
            values[:, :, :prompt_len] = v
            self.layers.append(_static_layer_class()(keys, values, self.col))
            cache.layers[i] = self.layers[-1]
        self.cache = cache
        dtype = self.layers[0].keys.dtype
        low = torch.finfo(dtype).min
        self.mask4d = torch.full((rows, 1, 1, length), low, dtype=dtype, device=device)
        self.mask4d[:, 0, 0, :prompt_len] = torch.where(mask.bool(), 0.0, low).to(dtype)
        self.pos = (position_ids[:, -1:] + 1).clone()  # (R, 1) position of the fed token
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.logits = logits.contiguous()  # (R, V) float32
        self.fed = torch.full((rows, 1), engine.pad_id, dtype=torch.long, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.alive = torch.ones(rows, dtype=torch.bool, device=device)
        ids = [] if sampling.ignore_eos else engine.eos_ids
        self.eos = torch.tensor(ids, dtype=torch.long, device=device)
        self.responses = torch.full((rows, max_new), engine.pad_id, dtype=torch.long, device=device)
        self.response_mask = torch.zeros(rows, max_new, dtype=torch.bool, device=device)
        self.log_probs = torch.zeros(rows, max_new, dtype=torch.float32, device=device)

    # ------------------------------------------------------------------ one step
    def _record(self) -> None:
        """Pick step ``self.step``'s tokens from ``self.logits`` and write them; every op in
        place on the buffers, no host sync (so it can live in a graph)."""
        token, token_logp = pick(self.logits, self.sampling, self.draws, self.step)
        finished = self.finished
        self.alive.copy_(~finished)
        token = token.masked_fill(finished, self.engine.pad_id)
        self.responses.index_copy_(1, self.step, token[:, None])
        self.response_mask.index_copy_(1, self.step, self.alive[:, None])
        self.log_probs.index_copy_(1, self.step, token_logp.masked_fill(finished, 0.0)[:, None])
        finished |= (token[:, None] == self.eos[None, :]).any(dim=1)
        self.fed.copy_(token[:, None])
        self.step += 1

    def _set_width(self, t: int) -> None:
        """Step ``t`` feeds column P + t - 1: attend to the first P + t columns, rounded up to
        a `BUCKET` (and at most the buffers' width)."""
        width = min(self.length, -(-(self.prompt_len + t) // BUCKET) * BUCKET)
        if width != self.width:
            self.width = width
            for layer in self.layers:
                layer.width = width

    def _advance(self) -> None:
        """Feed the last picked tokens (column ``col``, positions ``pos``), then pick the next."""
        self.mask4d.index_fill_(3, self.col, 0.0)
        mask = self.mask4d[:, :, :, : self.width]
        self.logits.copy_(self.engine._forward(self.fed, mask, self.pos, self.cache))
        self.col += 1
        self.pos += 1
        self._record()

    def _warm_up(self) -> None:
        """One real step, eagerly, on a side stream (CUDA's lazy set-ups happen outside any
        capture)."""
        if self.step.device.type != "cuda":
            self._advance()
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._advance()
        torch.cuda.current_stream().wait_stream(stream)

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        """Capture the next step at the current width without running it (the graphs of all
        widths share one memory pool: they never run at once). None (and a warning once) if
        capture fails."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread-local: another thread's CUDA call (a loader, a logger) cannot void it
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._advance()
        except Exception as err:  # any capture failure falls back to eager
            warn_once(f"hf engine: CUDA graph capture failed ({err!r}); decoding eagerly")
            torch.cuda.synchronize()
            return None
        return graph

    # ------------------------------------------------------------------ the loop
    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode to the end; ``(responses, response_mask, log_probs)`` as `HFEngine._sample`."""
        stop = self.sampling.stop
        tokenizer = self.engine.tokenizer
        stop_width = max((len(s) for s in stop), default=0) + 1

        def after(t: int) -> bool:  # host work after step t; True = every row finished
            if stop:
                ends = torch.full((self.rows,), t + 1, dtype=torch.long, device=self.step.device)
                self.finished |= stop_hits(
                    tokenizer, self.responses, ends, self.alive, stop, stop_width
                )
            if t + 1 == self.max_new:
                return True
            return (bool(stop) or (t + 1) % self.check_every == 0) and bool(self.finished.all())

        self._record()  # step 0 from the prefill's logits
        done, t = 1, 1
        ended = after(0)
        graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # one per width (None: failed)
        use_graphs = self.graphs and self.max_new >= 4
        with decode_attention_on(self.engine.model), fused_norms_on(self.engine.model):
            while not ended and t < self.max_new:
                self._set_width(t)
                graph = graphs.get(self.width) if use_graphs and t > 1 else None
                if use_graphs and t > 1 and graph is None:
                    graph = graphs[self.width] = self._capture()  # captured, not run
                    if graph is None:
                        use_graphs = self.graphs = False
                if graph is not None:
                    graph.replay()
                elif use_graphs:  # t == 1
                    self._warm_up()
                else:
                    self._advance()
                done = t + 1
                ended = after(t)
                t += 1
        steps = int(self.response_mask[:, :done].sum(dim=1).max()) if self.rows else 0
        return (
            self.responses[:, :steps],
            self.response_mask[:, :steps],
            self.log_probs[:, :steps],
        )


def static_sample(engine, input_ids, mask, position_ids, sampling, draws, first, inverse):
    """`HFEngine._sample` on static buffers (and CUDA graphs) as ``engine.decode`` says, or None
    where today's loop must run (``dynamic``, an unsupported model; said once)."""
    mode = resolve_decode(engine.decode, input_ids.device)
    if mode == "dynamic":
        return None
    dist = torch.distributed
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if mode == "graphs" and ranks > 1:  # a sharded forward's collectives stay out of graphs
        if engine.decode == "graphs":  # asked for, not auto's choice
            warn_once("hf engine: no CUDA graphs with several ranks; static cache, eagerly")
        mode = "static"
    why = static_supported(engine.model)
    if why is None:
        try:
            decode = StaticDecode(
                engine, input_ids, mask, position_ids, sampling, draws, first, inverse,
                graphs=mode == "graphs", check_every=engine.check_every,
            )  # fmt: skip
        except NotImplementedError as err:
            why = str(err)
    if why is not None:
        warn_once(f"hf engine: static decode off ({why}); decoding with today's loop")
        return None
    return decode.run()


class SessionKV:
    """A multi-turn session's KV cache (`lmrl.rollout.hf.HFSession`) on preallocated buffers.

    Every feed writes its W columns in place at the next free columns of (R, H, L, D) buffers
    (doubled, copied once, when full) and attends through a 4D additive mask built from the
    columns' validity, so no step concatenates the whole cache as ``DynamicCache`` does.
    Eager: the session's loop looks at its rows on the host every step anyway.

    Args:
        engine: the `HFEngine`; ``cache``: its ``DynamicCache`` after the prefill (R rows);
        attn: (R, P) the prompts' mask.
    """

    spare = 256  # free columns allocated past the prompts

    def __init__(self, engine, cache, attn: torch.Tensor) -> None:
        spare = self.spare
        layer_cls = _dynamic_layer()
        if not cache.layers or any(type(layer) is not layer_cls for layer in cache.layers):
            raise NotImplementedError("the model's cache is not plain DynamicLayers")
        self.engine, self.cache = engine, cache
        rows, self.used = attn.shape
        device = attn.device
        self.cols = torch.arange(self.used, device=device)
        self.valid = torch.zeros(rows, self.used + spare, dtype=torch.bool, device=device)
        self.valid[:, : self.used] = attn.bool()
        for i, layer in enumerate(cache.layers):
            cache.layers[i] = _static_layer_class()(
                self._grown(layer.keys, self.used + spare),
                self._grown(layer.values, self.used + spare),
                self.cols,
            )

    @staticmethod
    def _grown(x: torch.Tensor, length: int) -> torch.Tensor:
        out = x.new_zeros(*x.shape[:2], length, x.shape[3])
        out[:, :, : x.shape[2]] = x
        return out

    def feed(self, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor):
        """Run (R, W) ``ids`` (``valid`` bool (R, W) marks real tokens) at ``positions`` through
        the cache; the last column's logits (R, V) float32."""
        rows, width = ids.shape
        length = self.valid.shape[1]
        if self.used + width > length:  # grow: double, or more if one feed needs it
            length = max(2 * length, self.used + width)
            grown = self.valid.new_zeros(rows, length)
            grown[:, : self.valid.shape[1]] = self.valid
            self.valid = grown
            for layer in self.cache.layers:
                layer.keys = self._grown(layer.keys, length)
                layer.values = self._grown(layer.values, length)
        cols = torch.arange(self.used, self.used + width, device=ids.device)
        for layer in self.cache.layers:
            layer.col = cols
        self.valid[:, self.used : self.used + width] = valid
        keys = torch.arange(length, device=ids.device)
        allowed = self.valid[:, None, :] & (keys[None, None, :] <= cols[None, :, None])
        dtype = self.cache.layers[0].keys.dtype
        low = torch.finfo(dtype).min
        mask4d = torch.zeros(allowed.shape, dtype=dtype, device=ids.device)
        mask4d = mask4d.masked_fill(~allowed, low)[:, None]  # (R, 1, W, L)
        self.used += width
        return self.engine._forward(ids, mask4d, positions, self.cache)


def session_kv(engine, cache, attn: torch.Tensor) -> SessionKV | None:
    """A `SessionKV` over ``cache`` when ``engine.decode`` asks for a static cache (``static``,
    or ``graphs`` on CUDA: sessions run it eagerly) and the model allows, else None. ``auto``
    keeps sessions on ``DynamicCache``: the static session cache has not been timed on a GPU."""
    if engine.decode == "auto" or resolve_decode(engine.decode, attn.device) == "dynamic":
        return None
    why = static_supported(engine.model)
    if why is None:
        try:
            return SessionKV(engine, cache, attn)
        except NotImplementedError as err:
            why = str(err)
    warn_once(f"hf engine: static session cache off ({why}); sessions use DynamicCache")
    return None
