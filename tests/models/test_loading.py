"""Loading from a path: dtypes, the pad-token rule, checkpointing, and errors naming the path."""

from __future__ import annotations

import pytest
import torch
from transformers import ViTConfig

from lmrl.errors import ModelError
from lmrl.models import (
    ModelPathError,
    load_causal_lm,
    load_critic,
    load_tokenizer,
    resolve_dtype,
    set_pad_token,
)
from lmrl.models.tiny import build_tokenizer


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    for load in (load_causal_lm, load_tokenizer, load_critic):
        with pytest.raises(ModelPathError, match="no-such-model"):
            load(missing)
    with pytest.raises(ValueError, match="no-such-model"):  # also a ValueError
        load_causal_lm(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):  # and a FileNotFoundError
        load_causal_lm(str(missing))


def test_directory_without_config_and_file_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match=r"config\.json"):
        load_causal_lm(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelPathError, match="is a file"):
        load_causal_lm(tmp_path / "weights.bin")


def test_non_causal_model_is_refused(tmp_path):
    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"not a causal language model") as err:
        load_causal_lm(tmp_path)
    assert str(tmp_path) in str(err.value) and "vit" in str(err.value)


def test_dtypes_and_gradient_checkpointing(qwen_dir):
    assert resolve_dtype(None) == torch.float32
    assert resolve_dtype("bf16") == resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8")
    model = load_causal_lm(qwen_dir, dtype="bfloat16", gradient_checkpointing=True)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.config.use_cache is False
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert load_causal_lm(qwen_dir, dtype="float16").dtype == torch.float16


def test_pad_token_rule():
    tokenizer = build_tokenizer()
    assert set_pad_token(tokenizer).pad_token == "<|endoftext|>"  # an existing pad is kept
    tokenizer.pad_token = None
    assert set_pad_token(tokenizer).pad_token == "<|im_end|>"  # else the eos
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 258
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="neither a pad nor an eos"):
        set_pad_token(tokenizer)


def test_tokenizer_without_pad_gets_eos_on_load(qwen_dir, tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((qwen_dir / "config.json").read_text())
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == "<|im_end|>"
    assert loaded.chat_template == tokenizer.chat_template  # used as the tokenizer has it


def test_auto_dtype_is_float32_on_cpu():
    from lmrl.models.loading import resolve_dtype

    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype(None, "cpu") == torch.float32


@pytest.mark.parametrize("keep", [5, 0.5])  # a header cut short; the tensors cut short
def test_truncated_weights_name_the_file(qwen_dir, tmp_path, keep):
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(qwen_dir, model_dir)
    weights = model_dir / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(keep if isinstance(keep, int) else int(weights.stat().st_size * keep))
    with pytest.raises(ModelError) as err:
        load_causal_lm(model_dir)
    message = str(err.value)
    assert f"{weights} is damaged or truncated" in message and "\n" not in message
