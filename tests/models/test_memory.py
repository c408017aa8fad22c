"""The per-model arithmetic of ``lmrl plan``: parameter counts against built models, activation
bytes against what autograd really saves, sizes, and the live-tensor counter."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

from lmrl.models.lora import apply_lora
from lmrl.models.memory import (
    LiveTensorBytes,
    ModelShape,
    embedding_grad_bytes,
    format_bytes,
    parse_size,
)
from lmrl.models.tiny import tiny_config

QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                tie_word_embeddings=True)  # fmt: skip


def built_params(config, cls=AutoModelForCausalLM) -> int:
    with torch.device("meta"):
        model = cls.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("size", ["tiny", "small", "base"])
def test_param_count_matches_the_built_model(arch, size):
    config = tiny_config(arch, size)
    assert ModelShape.from_config(config).num_params() == built_params(config)


def test_param_count_of_a_qwen_sized_model_and_its_critic():
    config = Qwen2Config(**QWEN_05B)
    shape = ModelShape.from_config(config)
    assert shape.num_params() == built_params(config) == 494_032_768  # Qwen2.5-0.5B's count
    config.num_labels = 1
    critic = built_params(config, AutoModelForTokenClassification)
    assert shape.num_params(value_head=True) == critic


def test_from_a_config_json_dict_and_a_missing_field():
    shape = ModelShape.from_config({"model_type": "qwen2", **QWEN_05B})
    assert (shape.head_dim, shape.num_kv_heads, shape.qkv_bias) == (64, 2, True)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_config({"model_type": "bert", "vocab_size": 10})


def test_lora_params_match_peft():
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", "small"))
    shape = ModelShape.from_config(model.config)
    peft = apply_lora(model, 8)
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert shape.lora_params(8) == trainable
    assert shape.lora_params(8, ["q_proj", "v_proj"]) == 4 * 8 * ((192 + 192) + (192 + 64))


def saved_bytes(model, ids, mask) -> int:
    """Bytes of every tensor autograd saves in a forward (each storage once, weights not)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("lora", [0, 8])
def test_activation_bytes_match_what_autograd_saves(lora):
    """The decoder's saved tensors of a padded batch (so the mask exists), fp32: within 5%."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", "small"))
    shape = ModelShape.from_config(model.config)
    if lora:
        model = apply_lora(model, lora)
    model.train()
    backbone = model.get_base_model().model if lora else model.model
    b, length = 4, 64
    ids = torch.randint(0, 256, (b, length))
    mask = torch.ones(b, length, dtype=torch.long)
    mask[0, :3] = 0
    measured = saved_bytes(backbone, ids, mask)
    predicted = b * length * shape.activation_bytes_per_token(4, False, lora)
    predicted += shape.mask_bytes(b, length, 4)
    assert predicted == pytest.approx(measured, rel=0.05)


def test_checkpointing_keeps_layer_inputs_and_one_layer():
    shape = ModelShape.from_config(tiny_config("qwen2", "base"))
    full = shape.activation_bytes_per_token(4)
    checkpointed = shape.activation_bytes_per_token(4, checkpointing=True)
    layer = shape.layer_activation_bytes(4)
    assert checkpointed < full / 3
    assert checkpointed - layer == shape.num_layers * shape.hidden_size * 4 + 3 * 512 * 4 + 4


def test_kv_cache_and_logprob_chunks():
    shape = ModelShape.from_config(Qwen2Config(**QWEN_05B))
    assert shape.kv_cache_bytes_per_token(2) == 24 * 2 * 2 * 64 * 2  # 12 KiB a token
    assert shape.logprob_chunk_rows(10_000) == 2**24 // 151936  # 110 rows of fp32 logits
    assert shape.logprob_chunk_rows(5) == 5
    frozen = shape.logprob_bytes(1000, 2, grad=True, head_trains=False)
    trains = shape.logprob_bytes(1000, 2, grad=True, head_trains=True)
    assert trains - frozen > 151936 * 896 * 4  # the fp32 weight-gradient buffer (and its cast)
    assert shape.logprob_bytes(1000, 2, grad=False) <= frozen


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1.5 gib", 3 * 2**29),
     ("1024B", 1024), ("141e9B", 141 * 10**9)],
)  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "80XB", "-1GiB", "0", "GiB", "nanGiB", "80", "80G"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"
    assert format_bytes(300 * 2**20) == "300 MiB"


def test_live_tensor_bytes_counts_allocations_and_frees():
    x = torch.zeros(1000)  # 4000 bytes, alive before: counted once tracked
    with LiveTensorBytes() as live:
        live.track(x, x[10:])  # a view is the same storage
        assert live.current == 4000
        y = torch.ones(500, dtype=torch.float64)  # 4000 more
        assert live.current == 8000
        del y
        assert live.current == 4000 and live.peak == 8000
        z = x * 2  # noqa: F841
        assert live.current == 8000


def test_embedding_grad_of_a_tied_head_holds_three_copies():
    tied = ModelShape.from_config(Qwen2Config(**QWEN_05B))
    untied = ModelShape.from_config(Qwen2Config(**{**QWEN_05B, "tie_word_embeddings": False}))
    vh = 151936 * 896
    assert embedding_grad_bytes(tied, 4) == 3 * vh * 4
    assert embedding_grad_bytes(untied, 2) == vh * 2
