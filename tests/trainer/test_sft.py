"""SFT warm start: the loss itself, a short fit, the shared optimizer and schedule, the export,
the config and the CLI. Everything runs on the tiny (~0.1M) model. The data layouts and the
loss mask are tested in tests/data/test_sft.py."""

from __future__ import annotations

import json

import pytest
import torch
from tests.host_reads import HostReads

from lmrl.batch import Batch
from lmrl.cli import main
from lmrl.config import ConfigError
from lmrl.config.sft import load_sft_config
from lmrl.data import SFTDataset
from lmrl.data.tasks import write_task
from lmrl.models import build_tiny_model, load_causal_lm, load_tokenizer
from lmrl.rollout import HFEngine, SamplingParams
from lmrl.run.checkpoint import check_checkpoint
from lmrl.trainer.sft import SFTTrainer, build_sft
from lmrl.workers import sft as sft_module
from lmrl.workers.optim import TrainableWorker, lr_factor, warmup_steps
from lmrl.workers.sft import sft_token_log_probs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_task("digits", tmp_path_factory.mktemp("digits"), num_train=256, num_test=32)


def overrides(model_dir, train, run_dir, *extra):
    return [
        f"model.path={model_dir}",
        f"data.train_files={train}",
        f"trainer.default_local_dir={run_dir}",
        "model.enable_gradient_checkpointing=false",
        "trainer.device=cpu",
        "trainer.logger=[]",
        *extra,
    ]


# ---------------------------------------------------------------------------- the loss
def test_loss_and_gradient_equal_the_hf_loss_with_prompt_labels_ignored(
    tmp_path, model_dir, tokenizer, digits
):
    """Our masked token-mean equals transformers' own loss with labels=-100 on the prompt,
    and differs from the loss over every token: the prompt's targets are not trained."""
    data = SFTDataset(digits["test"], tokenizer, response_from_ground_truth=True)
    batch = data.collate(range(6))
    model = load_causal_lm(model_dir)
    log_probs, mask = sft_token_log_probs(model, batch)
    ours = -(log_probs[mask]).sum() / mask.sum()
    ours.backward()
    grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()

    labels = torch.where(batch["loss_mask"], batch["input_ids"], -100)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"].long()}
    reference = model(**inputs, labels=labels).loss
    reference.backward()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, model.model.embed_tokens.weight.grad, rtol=1e-4, atol=1e-7)

    every_token = torch.where(batch["attention_mask"], batch["input_ids"], -100)
    assert abs(model(**inputs, labels=every_token).loss.item() - ours.item()) > 1e-3


def test_micro_batches_accumulate_to_the_whole_batch_gradient(tmp_path, model_dir, digits):
    grads, losses = [], []
    for micro in ("null", "3"):
        cfg = load_sft_config(
            None,
            overrides(model_dir, digits["test"], tmp_path / micro,
                      "data.response_from_ground_truth=true", "data.train_batch_size=8",
                      f"data.micro_batch_size={micro}", "optim.grad_clip=1e9", "optim.lr=0"),
        )  # fmt: skip
        trainer = SFTTrainer(build_sft(cfg))
        trainer.worker.optimizer.zero_grad = lambda set_to_none=True: None  # keep the gradient
        losses.append(trainer.step()["sft/loss"])
        grads.append(torch.cat([p.grad.flatten() for p in trainer.worker.params]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_no_micro_batch_of_the_sft_update_reads_the_device_back(
    tmp_path, model_dir, digits, monkeypatch
):
    """Every micro-batch is split and laid out from the collated CPU pieces before any forward
    (`sft_batch`): the forwards then read nothing back; a piece split inside does."""
    cfg = load_sft_config(
        None,
        overrides(model_dir, digits["test"], tmp_path, "data.response_from_ground_truth=true",
                  "data.train_batch_size=8", "data.micro_batch_size=3"),
    )  # fmt: skip
    trainer = SFTTrainer(build_sft(cfg))
    reads, forward = HostReads(), sft_module.sft_token_log_probs

    def watched(model, batch):
        with reads:
            log_probs, mask = forward(model, batch)
            (log_probs * mask).sum().backward(retain_graph=True)  # the backward too
        return log_probs, mask

    monkeypatch.setattr(sft_module, "sft_token_log_probs", watched)
    trainer.step()
    assert reads.reads == []
    piece = SFTDataset(digits["test"], trainer.tokenizer, response_from_ground_truth=True)
    watched(trainer.worker.model, piece.collate(range(3)))
    assert any("sft_batch" in where for _, where in reads.reads)


# ---------------------------------------------------------------------------- fit and export
@pytest.fixture(scope="module")
def fitted(tmp_path_factory, model_dir, digits):
    run_dir = tmp_path_factory.mktemp("sft-run")
    cfg = load_sft_config(
        None,
        overrides(model_dir, digits["train"], run_dir, f"data.val_files={digits['test']}",
                  "data.response_from_ground_truth=true", "data.train_batch_size=16",
                  "optim.lr=3e-3", "trainer.total_training_steps=30", "trainer.test_freq=15",
                  "trainer.save_freq=20"),
    )  # fmt: skip
    trainer = SFTTrainer(build_sft(cfg))
    return trainer, trainer.fit()


def test_loss_falls_and_metrics_are_logged(fitted):
    trainer, history = fitted
    losses = [m["sft/loss"] for m in history]
    assert len(losses) == 30
    assert sum(losses[-3:]) / 3 < 0.75 * sum(losses[:3]) / 3
    val = [m["val/sft_loss"] for m in history if "val/sft_loss" in m]
    assert len(val) == 2 and val[-1] < 0.75 * losses[0]
    lines = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 31))
    for key in ("sft/loss", "sft/lr", "sft/grad_norm", "sft/tokens", "timing_s/step"):
        assert key in lines[0]
    assert lines[0]["sft/tokens"] == sum(trainer.train_data.examples[i][1].count(True)
                                         for i in trainer.sampler.order(0)[:16])  # fmt: skip
    assert (trainer.run_dir / "config.yaml").is_file()


def test_optimizer_and_schedule_are_a_trainable_workers(fitted):
    """SFT steps through the actor's and critic's optimizer code: a ``TrainableWorker``'s
    AdamW, and the shared warmup + cosine ``lr_factor`` (warmup from 0, as verl)."""
    trainer, history = fitted
    worker, optim = trainer.worker, trainer.cfg.optim
    assert isinstance(worker, TrainableWorker) and worker.model is trainer.model
    assert isinstance(worker.optimizer, torch.optim.AdamW)
    assert [p for g in worker.optimizer.param_groups for p in g["params"]] == worker.params
    total = trainer.total_steps
    warmup = warmup_steps(optim, total)
    assert (total, warmup, optim.lr_scheduler) == (30, 1, "cosine")  # warmup ratio 0.05

    def lr(step):
        return optim.lr * lr_factor(step, warmup, total, "cosine", optim.min_lr_ratio)

    # each step logs the lr it used: 0 at step 0 (warmup), the peak at step 1, then cosine
    assert [m["sft/lr"] for m in history] == pytest.approx([lr(s) for s in range(total)])
    assert history[0]["sft/lr"] == 0.0 and history[1]["sft/lr"] == pytest.approx(optim.lr)
    assert worker.lr == pytest.approx(lr(total))  # the schedule advanced once per step


def test_export_loads_as_a_model_path_and_generates(fitted):
    trainer, _ = fitted
    # resumable checkpoints at save_freq and at the end; the model itself is final/
    for step in (20, 30):
        assert check_checkpoint(trainer.run_dir / f"global_step_{step}") is None
        assert (trainer.run_dir / f"global_step_{step}" / "model.safetensors").is_file()
    model = load_causal_lm(trainer.final_dir)
    tokenizer = load_tokenizer(trainer.final_dir)
    for name, value in trainer.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
    assert model.config.use_cache is True
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "reverse 1234"}],
                                           tokenize=False, add_generation_prompt=True)  # fmt: skip
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)})
    out = HFEngine(model, tokenizer).generate(batch, 1, SamplingParams(do_sample=False,
                                                                       max_new_tokens=8))  # fmt: skip
    assert out["responses"].shape[0] == 1 and out["response_mask"].any()


def test_lora_export_is_merged(tmp_path, model_dir, digits):
    cfg = load_sft_config(
        None,
        overrides(model_dir, digits["test"], tmp_path, "data.response_from_ground_truth=true",
                  "data.train_batch_size=8", "model.lora_rank=4", "optim.lr=1e-2",
                  "optim.lr_warmup_steps=0", "trainer.total_training_steps=5",
                  f"data.val_files={digits['test']}"),
    )  # fmt: skip
    trainer = SFTTrainer(build_sft(cfg))
    history = trainer.fit(on_step_end=lambda step, metrics: step == 2)
    assert len(history) == 2 and "val/sft_loss" in history[-1] and trainer.global_step == 2
    assert not (trainer.final_dir / "adapter_config.json").exists()
    merged = load_causal_lm(trainer.final_dir)
    base = load_causal_lm(model_dir)
    ids = trainer.train_data.collate([0, 1])
    inputs = {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"].long()}
    with torch.no_grad():
        trained = trainer.model.eval()(**inputs).logits
        torch.testing.assert_close(merged(**inputs).logits, trained, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(base(**inputs).logits, trained, atol=1e-4)
        # and the adapter alone, in PEFT's format (final/adapter), on the base model
        from peft import PeftModel

        adapted = PeftModel.from_pretrained(base, str(trainer.final_dir / "adapter")).eval()
        torch.testing.assert_close(adapted(**inputs).logits, trained, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- config and CLI
def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown key 'optim.lrr'; did you mean 'optim.lr'"):
        load_sft_config(None, ["model.path=/m", "data.train_files=x", "optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"data.train_files is not set"):
        load_sft_config(None, ["model.path=/m"])
    with pytest.raises(ConfigError, match=r"data.micro_batch_size=0 must be >= 1"):
        load_sft_config(None, ["model.path=/m", "data.train_files=x", "data.micro_batch_size=0"])


def test_verl_sft_keys_map_onto_ours():
    notices: list[str] = []
    cfg = load_sft_config(
        None,
        ["model.partial_pretrain=/m", "data.train_files=x", "data.micro_batch_size_per_gpu=4",
         "optim.warmup_steps_ratio=0.1", "optim.clip_grad=0.5", "optim.warmup_style=constant",
         "data.multiturn.messages_key=chat", "model.fsdp_config.param_offload=true"],
        notices=notices,
    )  # fmt: skip
    assert cfg.model.path == "/m" and cfg.data.micro_batch_size == 4
    assert cfg.optim.lr_warmup_steps_ratio == 0.1 and cfg.optim.grad_clip == 0.5
    assert cfg.optim.lr_scheduler == "constant" and cfg.data.messages_key == "chat"
    assert len(notices) == 1 and "model.fsdp_config.param_offload" in notices[0]


def test_verl_sft_keys_come_from_the_one_table():
    """SFT's verl keys are rows of ``lmrl.config.verl.VERL_RULES`` for the SFT target; the
    same key means what it means to each schema (``trainer.nnodes``)."""
    from lmrl.config.sft import SFT_CONFIG
    from lmrl.config.verl import SFT, TRAIN, VERL_RULES, translate

    assert any(r.verl == "model.partial_pretrain" and SFT in r.targets for r in VERL_RULES)
    assert SFT_CONFIG.translate("model.partial_pretrain", "/m").path == "model.path"
    assert translate("optim.clip_grad", 0.5, SFT).path == "optim.grad_clip"
    assert translate("optim.clip_grad", 0.5, TRAIN).path == "optim.clip_grad"  # not an RL key
    assert translate("trainer.nnodes", 2, TRAIN).path == "resources.nnodes"
    assert translate("trainer.nnodes", 2, SFT).notice is not None
    assert SFT_CONFIG.spellings("model.path") == ["model.partial_pretrain"]


def test_cli_end_to_end(tmp_path, model_dir, digits, capsys):
    args = overrides(model_dir, digits["test"], tmp_path / "run",
                     "data.response_from_ground_truth=true", "data.train_batch_size=8",
                     "trainer.total_training_steps=2", "trainer.logger=console")  # fmt: skip
    assert main(["sft", *args]) == 0
    out = capsys.readouterr().out
    assert "step 2/2  loss " in out and f"model: {tmp_path / 'run' / 'final'}" in out
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    load_causal_lm(tmp_path / "run" / "final")

    assert main(["sft", "--help"]) == 0
    assert "data.response_from_ground_truth = false" in capsys.readouterr().out
    assert main(["sft", f"model.path={model_dir}", "data.train_fils=x"]) == 2
    assert "did you mean 'data.train_files'" in capsys.readouterr().err
