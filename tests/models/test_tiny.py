"""The tiny models and their tokenizer: build, save, reload through the user's loading path."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from lmrl.models import load_causal_lm, load_tokenizer
from lmrl.models.tiny import SIZES, build_tokenizer, tiny_config

TASK_TEXTS = [
    "What is 17 + 25? Show your work.\n#### 42",
    "Using the numbers [3, 7, 25, 50], create an equation that equals 100. (50 - 25) * (7 - 3)",
    "A very special island is inhabited only by knights and knaves. Knights always tell the truth,"
    " and knaves always lie. Zoey says: 'Oliver is a knave.'",
    "<think>2 * 3 = 6</think>\n<answer>6</answer>",
    "tabs\tand  double  spaces, unicode é → ∑ and emoji 🙂 round-trip",
]


@pytest.mark.parametrize("arch, cls", [("qwen2", Qwen2ForCausalLM), ("llama", LlamaForCausalLM)])
def test_build_and_reload_through_the_user_loader(arch, cls, qwen_dir, llama_dir):
    path = qwen_dir if arch == "qwen2" else llama_dir
    model = load_causal_lm(path)  # what model.path=/path/to/Qwen2.5-0.5B-Instruct goes through
    tokenizer = load_tokenizer(path)
    assert isinstance(model, cls) and model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer) == 259
    assert 80_000 < sum(p.numel() for p in model.parameters()) < 150_000
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == 256
    assert tokenizer.eos_token_id in model.generation_config.eos_token_id
    # Reloaded weights are the saved ones: the same seed builds the same model.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        fresh = cls(tiny_config(arch, "tiny"))
    for (name, a), (_, b) in zip(
        fresh.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("path_fixture", ["qwen_dir", "llama_dir"])
def test_round_trip_of_task_text(path_fixture, request):
    tokenizer = load_tokenizer(request.getfixturevalue(path_fixture))
    for text in TASK_TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Byte-level without merges: one token per byte, token id = byte value.
    assert tokenizer("Az 9\n")["input_ids"] == [65, 122, 32, 57, 10]
    assert len(tokenizer("é")["input_ids"]) == 2  # two UTF-8 bytes, no <unk>


def test_special_tokens_and_chat_template(qwen_dir):
    tokenizer = load_tokenizer(qwen_dir)
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 257
    assert tokenizer.padding_side == "left"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 257 and ids.count(258) == 2  # specials are single tokens
    assert tokenizer.decode(ids) == text
    assert (
        tokenizer.decode(ids, skip_special_tokens=True)
        == "system\nBe brief.\nuser\n2+2?\nassistant\n"
    )


def test_built_tokenizer_equals_the_reloaded_one(qwen_dir):
    built, loaded = build_tokenizer(), load_tokenizer(qwen_dir)
    for text in TASK_TEXTS:
        assert built(text)["input_ids"] == loaded(text)["input_ids"]


def test_sizes_and_bad_arguments(tmp_path):
    from transformers import Qwen2ForCausalLM as Q

    counts = {}
    for size in SIZES:
        with torch.device("meta"):
            counts[size] = sum(p.numel() for p in Q(tiny_config("qwen2", size)).parameters())
    assert 80e3 < counts["tiny"] < 150e3
    assert 1.5e6 < counts["small"] < 2.5e6
    assert 15e6 < counts["base"] < 25e6
    from lmrl.models.tiny import build_tiny_model

    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="size"):
        build_tiny_model(tmp_path, size="huge")


def test_cli_writes_a_loadable_model(tmp_path):
    from lmrl.cli import main

    assert main(["tiny-model", str(tmp_path / "m"), "--arch", "llama", "--seed", "3"]) == 0
    assert isinstance(load_causal_lm(tmp_path / "m"), LlamaForCausalLM)


def test_cli_refuses_a_non_empty_directory_without_force(tmp_path, capsys):
    from lmrl.cli import main

    out = tmp_path / "m"
    assert main(["tiny-model", str(out), "--seed", "1"]) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert main(["tiny-model", str(out), "--seed", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{out} is not empty" in err and "--force" in err and err.count("\n") == 1
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert main(["tiny-model", str(out), "--seed", "2", "--force"]) == 0
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    (tmp_path / "empty").mkdir()  # an empty directory is fine
    assert main(["tiny-model", str(tmp_path / "empty")]) == 0


def test_a_file_as_the_output_directory_is_a_model_error(tmp_path):
    from lmrl.errors import ModelError
    from lmrl.models.tiny import build_tiny_model

    (tmp_path / "f").write_text("x")
    with pytest.raises(ModelError, match="is a file, not a directory"):
        build_tiny_model(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"
