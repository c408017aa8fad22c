"""Tiny models and a local tokenizer, for tests, the demo and smoke runs.

Nothing can be downloaded here, so lmrl builds its own: a byte-level tokenizer made with the
``tokenizers`` library and a Qwen2 or Llama causal LM built from a config with a seeded
initialization. Both are written with ``save_pretrained``, so loading them goes through exactly
the path a user's ``model.path=/path/to/Qwen2.5-0.5B-Instruct`` takes (``lmrl.models.load_tokenizer``
/ ``load_causal_lm``, i.e. ``AutoTokenizer`` / ``AutoModelForCausalLM``).

Choice: the tokenizer is Qwen2's own pipeline (NFC, Qwen's pre-tokenizer regex, GPT-2 byte-level
mapping, BPE) with the 256 byte symbols as the whole vocabulary and no merges, plus Qwen's
special tokens and its ChatML chat template. Without merges every byte is one token, so for the
built-in tasks' ASCII text it is a character-level tokenizer: ~260 tokens, a tiny embedding, and
any text round-trips exactly (no ``<unk>`` is ever needed: a non-ASCII character is a few byte
tokens). Copying Qwen2's pipeline rather than inventing one matters: ``transformers`` 5 loads
every ``qwen2`` checkpoint with ``Qwen2Tokenizer``, which rebuilds that pipeline around the saved
vocabulary, so any other design would be silently re-tokenized on load. Token id = byte value for
ids 0-255; the special tokens follow.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import GenerationConfig, PreTrainedTokenizerFast

from lmrl.errors import ModelError

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_LENGTH = 4096

# Qwen2's pre-tokenizer: contractions, words, single digits, punctuation runs, whitespace.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5's ChatML layout without its default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# name -> (hidden, layers, heads, kv_heads, intermediate, tie_word_embeddings)
SIZES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "tiny": (64, 2, 4, 2, 176, True),  # ~0.1M parameters
    "small": (192, 4, 6, 2, 640, True),  # ~2M
    "base": (512, 7, 8, 4, 1408, False),  # ~20M
}
ARCHS = ("qwen2", "llama")


def byte_symbols() -> list[str]:
    """GPT-2's reversible byte -> printable character map, as a list indexed by byte value.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are shifted
    to code points 256 and up, so that every byte string becomes a string without whitespace.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    symbols, shifted = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return [symbols[b] for b in range(256)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer (no files read, nothing downloaded).

    Ids: byte value for 0-255 (so ``"a"`` is 97), then ``<|endoftext|>`` = 256 (pad),
    ``<|im_start|>`` = 257, ``<|im_end|>`` = 258 (eos).

    Returns:
        A ``PreTrainedTokenizerFast`` with ``pad_token``, ``eos_token``, left padding and a
        ChatML ``chat_template`` supporting ``add_generation_prompt``.
    """
    vocab = {sym: i for i, sym in enumerate(byte_symbols())}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=None,
        bos_token=None,
        model_max_length=MAX_LENGTH,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(arch: str = "qwen2", size: str = "tiny", vocab_size: int | None = None):
    """The ``transformers`` config of a tiny model.

    Args:
        arch: ``"qwen2"`` or ``"llama"``.
        size: ``"tiny"`` (~100k parameters), ``"small"`` (~2M) or ``"base"`` (~20M).
        vocab_size: defaults to the byte tokenizer's size.
    Raises:
        ModelError: an unknown arch or size (the message lists the valid ones).
    """
    if arch not in ARCHS:
        raise ModelError(f"arch must be one of {list(ARCHS)}, got {arch!r}")
    if size not in SIZES:
        raise ModelError(f"size must be one of {list(SIZES)}, got {size!r}")
    hidden, layers, heads, kv_heads, inter, tie = SIZES[size]
    ids = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
    common = dict(
        vocab_size=vocab_size or VOCAB_SIZE,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        max_position_embeddings=MAX_LENGTH,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD_TOKEN],
        initializer_range=0.02,
    )
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    from transformers import LlamaConfig

    return LlamaConfig(**common)


def build_tiny_model(
    out_dir: str | Path, arch: str = "qwen2", size: str = "tiny", seed: int = 0
) -> Path:
    """Build a tiny causal LM and its tokenizer and save both to ``out_dir``.

    The weights are float32, initialized from ``seed`` (the global RNG is left untouched), so
    the same arguments always write the same model.

    Args:
        out_dir: directory to write (created if missing).
        arch: ``"qwen2"`` (Qwen2ForCausalLM) or ``"llama"`` (LlamaForCausalLM).
        size: ``"tiny"`` (~100k parameters), ``"small"`` (~2M) or ``"base"`` (~20M).
        seed: initialization seed.

    Returns:
        ``out_dir`` as a ``Path``, loadable with ``AutoModelForCausalLM`` and ``AutoTokenizer``.
    """
    return save_model(tiny_config(arch, size), out_dir, seed)


def save_model(config, out_dir: str | Path, seed: int = 0) -> Path:
    """Initialize a causal LM of ``config`` (a Qwen2 or Llama config) from ``seed``, in float32,
    and save it with lmrl's byte tokenizer to ``out_dir``; the global RNG is left untouched.

    The config's vocabulary may be larger than the tokenizer's (a benchmark paying for a
    full-size embedding and head): the extra ids are never produced.

    Returns:
        ``out_dir`` as a ``Path``, loadable with ``AutoModelForCausalLM`` and ``AutoTokenizer``.
    Raises:
        ModelError: ``out_dir`` is a file or cannot be written (checked before building).
    """
    from transformers import AutoModelForCausalLM

    return init_and_save(AutoModelForCausalLM, config, out_dir, seed, build_tokenizer)


def init_and_save(auto, config, out_dir: str | Path, seed: int, tokenizer, processor=None) -> Path:
    """``auto.from_config(config)`` initialized from ``seed`` in float32 (the global RNG left
    untouched), saved to ``out_dir`` with ``tokenizer()``'s tokenizer (or ``processor(it)``,
    the processor built around it, when given).

    Raises:
        ModelError: ``out_dir`` is a file or cannot be written (checked before building).
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ModelError(f"{out} is a file, not a directory; give a directory for the model")
    tok = tokenizer()
    saved = tok if processor is None else processor(tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.eos_token_id, tok.pad_token_id],
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    try:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        saved.save_pretrained(out)
    except OSError as err:  # a parent that is a file, no permission, a full disk
        raise ModelError(f"cannot write the model to {out}: {err}") from None
    return out


def build_tiny_reward_model(
    out_dir: str | Path, arch: str = "qwen2", size: str = "tiny", seed: int = 0
) -> Path:
    """A tiny reward model: a one-label sequence classifier (``AutoModelForSequenceClassification``,
    ``num_labels=1``) of the tiny architecture, with lmrl's byte tokenizer, initialized from
    ``seed`` and saved to ``out_dir`` (the global RNG is left untouched).

    Its score is an arbitrary but fixed function of the text: what ``reward_model.enable``
    needs to be exercised end to end without downloading a trained one.
    """
    from transformers import AutoModelForSequenceClassification

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ModelError(f"{out} is a file, not a directory; give a directory for the model")
    config = tiny_config(arch, size)
    config.num_labels = 1
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config).to(torch.float32)
        with torch.no_grad():  # a score of order 1, not the 0.02-scale default
            model.score.weight.normal_(0.0, 1.0 / config.hidden_size**0.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
