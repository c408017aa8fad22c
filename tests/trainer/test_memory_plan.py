"""``lmrl plan`` against measurement, and its command line.

The measurement: one real actor update (the actor worker that ``build_workers`` makes from the
same config the plan reads) on this CPU, its peak of live tensor bytes counted exactly by
`lmrl.models.memory.LiveTensorBytes` (a TorchDispatchMode that tracks every tensor storage
from allocation to free; the model's parameters, buffers and optimizer state are registered
first). The update measured is the second one, as in every step of a run after the first:
AdamW's moments exist. The plan's ``actor update`` phase must be within 20% of that peak.
"""

from __future__ import annotations

import json

import pytest
import torch

from lmrl.batch import Batch
from lmrl.cli import main
from lmrl.config import load_config
from lmrl.models import build_tiny_model, load_tokenizer
from lmrl.models.memory import LiveTensorBytes, ModelShape, format_bytes
from lmrl.models.tiny import save_model, tiny_config
from lmrl.trainer.memory_plan import PARTS, load_plan_config
from lmrl.trainer.memory_plan import plan_memory as plan_of_run
from lmrl.trainer.plan import RunPlan
from lmrl.workers.build import build_workers

B, P, T, MICRO = 4, 48, 48, 2


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these updates are small, and a shared CPU oversubscribed by a
    second thread runs them several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-models")
    models = {size: build_tiny_model(root / size, size=size) for size in ("tiny", "small", "base")}
    # Qwen's vocabulary on the small body: the output head and its buffers dominate
    big_vocab = tiny_config("qwen2", "small", vocab_size=151936)
    models["small-v152k"] = save_model(big_vocab, root / "small-v152k")
    return models


def plan_memory(cfg, device_memory=None, **kwargs):
    """``lmrl plan``'s memory plan of ``cfg``: through the run's plan, as the command makes it."""
    return plan_of_run(RunPlan.from_config(cfg), device_memory, **kwargs)


def run_config(path, *overrides):
    return load_config(
        None,
        [
            f"model.path={path}", "trainer.device=cpu", "model.dtype=float32",
            "algorithm.adv_estimator=reinforce_plus_plus", "rollout.n=1",
            f"data.max_prompt_length={P}", f"data.max_response_length={T}",
            f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={B}",
            f"actor.ppo_micro_batch_size={MICRO}", *overrides,
        ],
        required=("model.path",),
    )  # fmt: skip


def update_batch() -> Batch:
    """``B`` rows of ``P + T`` tokens, every response full length (the plan's case), one row
    with a left-padded prompt and one with a short response (so a padding mask exists)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (B, P + T), generator=g)
    mask = torch.ones(B, P + T, dtype=torch.bool)
    mask[0, :5] = False
    mask[1, -3:] = False
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.long().cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, P:],
            "response_mask": mask[:, P:],
            "advantages": torch.randn(B, T, generator=g),
            "old_log_probs": torch.zeros(B, T),
        }
    )


def measured_update_peak(cfg) -> int:
    """Peak live tensor bytes of the second actor update of the worker the trainer builds."""
    torch.manual_seed(0)
    workers = build_workers(
        cfg, RunPlan.from_config(cfg, "cpu").workers, load_tokenizer(cfg.model.path),
        torch.device("cpu"), total_steps=10,
        roles=frozenset({"actor"}),
    )  # fmt: skip
    actor, batch = workers.actor, update_batch()
    actor.update_actor(batch)  # AdamW's moments now exist, as in every later step
    model = actor.model
    state = [v for s in actor.optimizer.state.values() for v in s.values()]
    with LiveTensorBytes() as live:
        live.track(*model.parameters(), *model.buffers(), *state)
        actor.update_actor(batch)
    return live.peak


@pytest.mark.parametrize(
    ("size", "overrides"),
    [
        ("tiny", ["model.enable_gradient_checkpointing=false"]),
        ("tiny", ["model.enable_gradient_checkpointing=true"]),
        ("tiny", ["model.lora_rank=8"]),
        ("small", ["model.enable_gradient_checkpointing=false"]),
        ("small", ["model.enable_gradient_checkpointing=true"]),
        ("small", ["model.lora_rank=8", "model.enable_gradient_checkpointing=false"]),
        ("base", ["model.enable_gradient_checkpointing=false"]),
        ("base", ["model.enable_gradient_checkpointing=true"]),
        ("base", ["model.lora_rank=8"]),
        # fp32 masters and moments, bf16 autocast compute (the GPU default), on this CPU
        ("small", ["model.mixed_precision.param_dtype=bfloat16",
                   "model.enable_gradient_checkpointing=false"]),
        ("base", ["model.mixed_precision.param_dtype=bfloat16"]),
        ("small-v152k", ["model.mixed_precision.param_dtype=bfloat16"]),
    ],
)  # fmt: skip
def test_actor_update_within_20_percent_of_measured(models, size, overrides):
    cfg = run_config(models[size], *overrides)
    predicted = next(p for p in plan_memory(cfg).phases if p.name == "actor update").total
    measured = measured_update_peak(cfg)
    ratio = predicted / measured
    print(f"{size} {overrides}: predicted {format_bytes(predicted)}, measured "
          f"{format_bytes(measured)}, ratio {ratio:.3f}")  # fmt: skip
    assert 0.8 <= ratio <= 1.2


def test_phases_and_parts(models):
    cfg = run_config(
        models["small"], "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
        "rollout.log_prob_micro_batch_size=4", "actor.ppo_epochs=2",
    )  # fmt: skip
    plan = plan_memory(cfg)
    names = [p.name for p in plan.phases]
    assert names == ["rollout", "old log-probs", "ref", "critic update", "actor update"]
    # one epoch of one mini-batch: the old log-probs come from the update, as in the run
    one_pass = plan_memory(run_config(models["small"], "algorithm.adv_estimator=gae"))
    assert [p.name for p in one_pass.phases] == ["rollout", "critic update", "actor update"]
    for phase in plan.phases:
        assert set(phase.parts) == set(PARTS)
        assert all(v >= 0 for v in phase.parts.values())
    actor = plan.phases[-1].parts
    params = plan.settings["params"]
    assert actor["params"] == 4 * params  # fp32, no mixed precision: the weights themselves
    assert actor["grads"] == 4 * params
    assert actor["optimizer"] == 8 * params
    assert actor["masters"] == 0
    assert actor["resident"] > 0  # the colocated critic and the frozen reference
    rollout = plan.phases[0].parts
    kv = 4 * 2 * 2 * (192 // 6) * 4 * (P + T) * B  # layers x 2 x kv heads x head_dim x fp32
    assert rollout["kv_cache"] == kv
    assert plan.fits is None and plan.max_micro_batch is None


def test_gradient_checkpointing_and_lora_lower_the_update(models):
    def update(*overrides):
        return plan_memory(run_config(models["base"], *overrides)).phases[-1]

    full = update("model.enable_gradient_checkpointing=false")
    checkpointed = update("model.enable_gradient_checkpointing=true")
    lora = update("model.lora_rank=8", "model.enable_gradient_checkpointing=false")
    assert checkpointed.parts["activations"] < full.parts["activations"]
    assert checkpointed.parts["params"] == full.parts["params"]
    assert lora.parts["grads"] < full.parts["grads"] / 10
    assert lora.parts["optimizer"] < full.parts["optimizer"] / 10


def test_mixed_precision_fsdp2_sharding_and_offload(models):
    base = ["model.mixed_precision.param_dtype=bfloat16", "trainer.device=cuda"]
    one = plan_memory(run_config(models["base"], *base)).phases[-1].parts
    shape = ModelShape.from_config(tiny_config("qwen2", "base"))
    linear = shape.num_layers * sum(i * o for i, o, _ in shape.linear_shapes().values())
    assert one["masters"] == 4 * shape.num_params()
    assert one["params"] == 2 * linear  # autocast's bf16 copies of the linear weights
    ray = ["trainer.backend=ray", "resources.n_gpus_per_node=4", "actor.strategy=fsdp2",
           "actor.ppo_micro_batch_size=1"]  # fmt: skip
    sharded = plan_memory(run_config(models["base"], *base, *ray)).phases[-1].parts
    assert sharded["masters"] == pytest.approx(one["masters"] / 4, rel=1e-3)
    assert sharded["optimizer"] == pytest.approx(one["optimizer"] / 4, rel=1e-3)
    assert sharded["params"] < one["params"]  # one layer and the root in flight
    offloaded = plan_memory(run_config(models["base"], *base, *ray, "actor.offload=both"))
    parts = offloaded.phases[-1].parts
    assert parts["masters"] == parts["grads"] == parts["optimizer"] == 0
    assert parts["params"] == sharded["params"]


def test_device_memory_gives_the_largest_micro_batch(models):
    cfg = run_config(models["base"], "rollout.log_prob_micro_batch_size=1")
    big = plan_memory(cfg, device_memory=2**40)
    assert big.fits and big.max_micro_batch == B  # capped at the mini-batch per rank
    update = big.phases[-1].total
    tight = plan_memory(cfg, device_memory=update - 1)
    assert tight.fits is False
    assert tight.max_micro_batch is not None and tight.max_micro_batch < MICRO
    assert "does NOT fit" in tight.summary()
    assert plan_memory(cfg, device_memory=1).max_micro_batch is None


def test_vllm_is_planned_without_vllm_installed(models):
    cfg = load_plan_config(
        None, [f"model.path={models['tiny']}", "rollout.name=vllm",
               "rollout.vllm.gpu_memory_utilization=0.4"],
    )  # fmt: skip
    plan = plan_memory(cfg, device_memory=80 * 2**30)
    rollout = plan.phases[0]
    assert rollout.parts["vllm"] == int(0.4 * 80 * 2**30)
    assert rollout.parts["kv_cache"] == 0 and "KV cache needs" in rollout.note


def test_cli_table_and_json(models, capsys):
    args = ["plan", f"model.path={models['small']}", "--device-memory", "64GiB",
            "trainer.device=cpu"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    for name in ("rollout", "old log-probs", "actor update", "largest micro-batch"):
        assert name in out
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["device_memory"] == 64 * 2**30
    assert [p["name"] for p in plan["phases"]][-1] == "actor update"


def test_cli_shows_the_mixture_the_run_draws(models, capsys):
    """``lmrl plan`` names the sources of ``data.mixture`` with their rules, from the same
    plan the run's sampler is built from; a bad mixture is refused in one line."""
    args = ["plan", f"model.path={models['small']}", "trainer.device=cpu",
            "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
            "+data.mixture.digits=[[1,1],[100,3]]",
            "+data.mixture.sort=1"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "data: 8 prompts a step mixed from digits weight 1 -> 3 at steps 1, 100, " in out
    assert "sort weight 1" in out
    quotas = ["+data.mixture.digits={quota: 6}", "+data.mixture.sort={quota: 1}"]
    assert main([*args[:5], *quotas]) == 2
    assert "the quotas sum to 7, not the 8" in capsys.readouterr().err
    assert main(args[:5]) == 0
    assert "data: 8 prompts a step from one pool of the training rows" in capsys.readouterr().out
    assert main([*args, "+data.curriculum={enable: true, mode: target}"]) == 0
    out = capsys.readouterr().out
    assert "sort weight 1; prompts by pass rate: target 0.5 (history 1)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model.path=/no/such/model"], "is not a directory"),
        (["--device-memory", "lots"], "cannot read 'lots' as a memory size"),
        (["--device-memory=-3GiB"], "as a memory size"),
    ],
)
def test_cli_bad_inputs_one_line_exit_2(models, tmp_path, capsys, args, message):
    if not any(a.startswith("model.path") for a in args):
        args = [f"model.path={models['tiny']}", *args]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_model_dir_without_config_json(tmp_path, capsys):
    assert main(["plan", f"model.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "has no config.json" in err and err.count("\n") == 1


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "vit", "hidden_size": 768, "num_hidden_layers": 12,
          "num_attention_heads": 12, "intermediate_size": 3072, "image_size": 224},
         "a vit config without vocab_size: lmrl plan plans decoder-only causal LMs"),
        ({"_class_name": "UNet2DConditionModel", "_diffusers_version": "0.30.0",
          "block_out_channels": [320, 640], "cross_attention_dim": 768},
         "a diffusers UNet2DConditionModel config (_class_name), not a causal language model"),
        ({"model_type": "llama", "vocab_size": 100}, "a llama config without hidden_size"),
        ({**LLAMA, "hidden_size": "64"},
         "hidden_size='64' must be a positive integer (a JSON number, not a string)"),
        ({**LLAMA, "tie_word_embeddings": "false"},
         "tie_word_embeddings='false' must be true or false"),
    ],
    ids=["vit", "unet", "no-hidden-size", "string-size", "string-flag"],
)  # fmt: skip
def test_cli_a_config_of_another_model_is_one_line_naming_the_path(
    tmp_path, capsys, config, message
):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", f"model.path={tmp_path}", "trainer.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert message in err and f"model.path='{tmp_path}'" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_a_diffusers_pipeline_is_named_as_one(tmp_path, capsys):
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    assert main(["plan", f"model.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"model.path='{tmp_path}' is a diffusers pipeline (StableDiffusion3Pipeline" in err
    assert "image runs (lmrl train-flow) have no memory plan" in err and err.count("\n") == 1
    (tmp_path / "model_index.json").write_text('{"_class_name": ')  # cut short
    assert main(["plan", f"model.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"cannot read {tmp_path / 'model_index.json'}: not valid JSON (Expecting" in err
    assert err.count("\n") == 1


def test_cli_a_device_memory_without_a_unit_is_refused(capsys):
    """``--device-memory 80`` is not 80 bytes: the size needs its unit."""
    assert main(["plan", "model.path=/no/such/model", "--device-memory", "80"]) == 2
    err = capsys.readouterr().err
    assert "--device-memory: memory size '80' has no unit: give one, e.g. 80GiB" in err
    assert err.count("\n") == 1


def test_pure_bf16_and_auto_dtypes(models):
    """model.dtype=bfloat16: no masters, bf16 grads and moments; auto compute on a GPU is
    bf16 over fp32 masters, and on a CPU fp32 (no mixed precision)."""

    def update(*overrides):
        plan = plan_memory(run_config(models["base"], *overrides))
        return plan.phases[-1].parts, plan.settings["params"]

    parts, params = update("model.dtype=bfloat16", "trainer.device=cuda")
    assert parts["masters"] == 0 and parts["params"] == 2 * params
    assert parts["grads"] == 2 * params and parts["optimizer"] == 4 * params
    gpu, _ = update("trainer.device=cuda")
    assert gpu["masters"] == 4 * params and 0 < gpu["params"] < 2 * params
    cpu, _ = update("trainer.device=cpu")
    assert cpu["masters"] == 0 and cpu["params"] == 4 * params


def test_an_out_of_memory_in_a_run_is_one_line_quoting_the_plan(
    tiny_workspace, tiny_overrides, tmp_path, capsys, monkeypatch
):
    """`lmrl train` that runs out of memory mid-step: exit 2, torch's first line and the memory
    plan's summary, no traceback."""
    from lmrl.workers.actor import ActorWorker

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setattr(ActorWorker, "update_actor", oom)
    code = main(["train", *tiny_overrides(tiny_workspace, tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB; memory plan: peak" in err
    assert "`lmrl plan` with the same keys" in err and "Traceback" not in err
