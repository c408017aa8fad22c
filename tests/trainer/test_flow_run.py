"""Flow-GRPO runs (``lmrl train-flow``): a run's outputs, exact resume, bad input, the demo."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from lmrl.cli import main as cli_main
from lmrl.config.errors import ConfigError
from lmrl.config.flow import load_flow_config
from lmrl.errors import CheckpointError
from lmrl.trainer.flow import FlowTrainer, build_flow


def flow_trainer(args) -> FlowTrainer:
    """``lmrl train-flow``'s program for these arguments (built, not run)."""
    return FlowTrainer(build_flow(load_flow_config(None, args)))


def _args(root, run, *extra):
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}",
        f"trainer.default_local_dir={run}",
        "trainer.logger=[]", "trainer.total_training_steps=4", "trainer.save_freq=2",
        "trainer.test_freq=2", "data.train_batch_size=2", "sampler.n=2",
        "sampler.num_steps=4", "sampler.val_num_steps=4", "actor.micro_batch_size=2",
        "actor.ppo_mini_batch_size=2", "actor.clip_range=0.2", "actor.optim.lr=1e-3",
        "trainer.device=cpu", *extra,
    ]  # fmt: skip


def test_a_flow_run_trains_validates_checkpoints_and_plots(flow_workspace, tmp_path):
    from lmrl.logging.plot import plot_run

    run = tmp_path / "run"
    extra = ("actor.beta=0.1", "actor.recompute_old_log_probs=true",
             "trainer.val_images_per_prompt=2")  # fmt: skip
    trainer = flow_trainer(_args(flow_workspace, run, *extra))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    history = trainer.fit()
    assert trainer.global_step == 4 and len(history) == 4
    assert sorted(trainer.validations) == [0, 2, 4]
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    steps = [m for m in lines if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    for key in ("flow/zero_spread_groups", "flow/check/shape", "actor/pg_loss",
                "actor/kl_loss", "perf/images_per_s", "timing_s/update"):  # fmt: skip
        assert key in steps[0], key
    vals = [m for m in lines if "val/shapes/reward/mean" in m]
    assert [m["step"] for m in vals] == [0, 2, 4]
    for m in vals:  # the checks of the validation images, and their mean is the reward
        checks = [m[f"val/shapes/check/{c}"] for c in ("colour", "count", "shape", "position")]
        assert sum(checks) / 4 == pytest.approx(m["val/shapes/reward/mean"])
    from PIL import Image

    cell = (trainer.image_shape[-1] + 2) * 4  # image_grid: a 1-pixel border, scaled 4x
    grid = Image.open(run / "samples" / "step_0.png")  # 2 images a prompt, one row per prompt
    assert grid.size == (2 * cell, len(trainer.val_prompts) * cell)
    assert {p.name for p in (run / "samples").iterdir()} == {
        "step_0.png",
        "step_2.png",
        "step_4.png",
    }
    assert (run / "global_step_2").is_dir() and (run / "global_step_4").is_dir()
    assert plot_run(run).is_file()
    from lmrl.flow.image_model import ImageFlow

    exported = ImageFlow.load(run / "final").state_dict()  # final/ is a model path
    assert all(torch.equal(exported[k], v.cpu()) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("actor.ema=true", "actor.ema_every=1"),
        ("sampler.sde_steps=1", "sampler.sde_window_range=[0,4]"),  # a window drawn each step
    ],
)
def test_a_run_stopped_after_a_checkpoint_resumes_bitwise_exact(flow_workspace, tmp_path, extra):
    whole = flow_trainer(_args(flow_workspace, tmp_path / "whole", *extra))
    history = whole.fit()
    starts = [m["flow/sde_start"] for m in history]
    windows = {0.0, 1.0, 2.0, 3.0} if "sampler.sde_steps=1" in extra else {0.0}
    assert set(starts) == windows, starts  # seeded: each of the four steps draws its own

    class Stop(Exception):
        pass

    cut = flow_trainer(_args(flow_workspace, tmp_path / "cut", *extra))
    step = cut.step

    def step_then_die():
        if cut.global_step == 3:  # dies in step 4, after the step-2 checkpoint
            raise Stop
        return step()

    cut.step = step_then_die
    with pytest.raises(Stop):
        cut.fit()
    resumed = flow_trainer(_args(flow_workspace, tmp_path / "cut", *extra))
    assert resumed.global_step == 2
    resumed.fit()
    expected = load_file(tmp_path / "whole" / "global_step_4" / "model.safetensors")
    actual = load_file(tmp_path / "cut" / "global_step_4" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    if "actor.ema=true" in extra:  # the weights' average too (two optimizer steps a step)
        assert resumed.ema.calls == whole.ema.calls == 8
        for a, b in zip(whole.ema.averaged(), resumed.ema.averaged(), strict=True):
            assert torch.equal(a, b)


def test_validation_samples_with_the_weights_average(flow_workspace, tmp_path, monkeypatch):
    run = tmp_path / "run"
    args = _args(flow_workspace, run, "actor.ema=true", "actor.ema_every=1",
                 "trainer.total_training_steps=2")  # fmt: skip
    trainer = flow_trainer(args)
    trainer.fit()
    entered = []
    applied = trainer.ema.applied

    def recording():
        entered.append([p.detach().clone() for p in trainer.ema.parameters])
        return applied()

    monkeypatch.setattr(trainer.ema, "applied", recording)
    trainer.validate()
    assert len(entered) == 1
    # the average differs from the trained weights, which are back after validation
    live = [p.detach() for p in trainer.ema.parameters]
    assert any(not torch.equal(a, w) for a, w in zip(trainer.ema.averaged(), live, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(entered[0], live, strict=True))
    # a run with EMA cannot resume a checkpoint written without one
    plain = tmp_path / "plain"
    flow_trainer(_args(flow_workspace, plain, "trainer.total_training_steps=2")).fit()
    with pytest.raises(CheckpointError, match="holds no EMA"):
        flow_trainer(
            _args(flow_workspace, plain, "actor.ema=true", "trainer.allow_config_change=true")
        )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["sampler.n=1"], "sampler.n=1 must be >= 2"),
        (["actor.ppo_mini_batch_size=3"], "must divide the images of a step"),
        (["sampler.sde_start=9"], "sampler.sde_start=9"),
        (["sampler.sde_window_range=[0,4]"], "sampler.sde_window_range needs sampler.sde_steps"),
        (
            ["sampler.sde_steps=2", "sampler.sde_window_range=[3,4]"],
            "sampler.sde_window_range=[3, 4] must hold a window of sampler.sde_steps=2",
        ),
        (
            ["sampler.sde_steps=1", "sampler.sde_start=1", "sampler.sde_window_range=[0,4]"],
            "sampler.sde_start=1 and sampler.sde_window_range both place the SDE window",
        ),
        (["actor.ema_decay=1.0"], "actor.ema_decay=1.0 must be in [0, 1)"),
        (["reward.name=pickscore"], "reward.name='pickscore' is not a built-in image reward"),
        (["model.path=/nowhere"], "model.path=/nowhere is not an image flow model"),
        (["data.train_files=/nowhere.parquet"], "cannot read prompt file /nowhere.parquet"),
        (["data.train_batch_size=61"], "more than the 60 prompts"),
        pytest.param(
            ["trainer.device=cuda"],
            "trainer.device=cuda but CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
    ],
)
def test_bad_flow_input_is_a_one_line_error(flow_workspace, tmp_path, capsys, extra, message):
    code = cli_main(["train-flow", *_args(flow_workspace, tmp_path / "bad"), *extra])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert message in err and "Traceback" not in err


@pytest.mark.gpu
def test_a_flow_run_on_a_gpu_checkpoints_what_a_cpu_run_resumes(flow_workspace, tmp_path):
    run = tmp_path / "run"
    extra = ("trainer.total_training_steps=2", "actor.beta=0.1", "actor.ema=true",
             "actor.ema_every=1", "actor.recompute_old_log_probs=true",
             "trainer.device=cuda")  # fmt: skip
    gpu = flow_trainer(_args(flow_workspace, run, *extra))
    assert next(gpu.model.parameters()).is_cuda
    history = gpu.fit()
    assert all(torch.isfinite(torch.tensor(v)) for h in history for v in h.values())
    assert sorted(gpu.validations) == [0, 2]
    saved = load_file(run / "global_step_2" / "model.safetensors")
    for key, value in gpu.model.state_dict().items():
        assert torch.equal(saved[key], value.cpu()), key
    # the GPU run's checkpoint resumes on the CPU (its weights' average too) and trains on
    more = ("trainer.total_training_steps=3", "actor.beta=0.1", "actor.ema=true",
            "actor.ema_every=1")  # fmt: skip
    cpu = flow_trainer(_args(flow_workspace, run, *more))
    assert cpu.global_step == 2 and cpu.ema.calls == gpu.ema.calls
    for a, b in zip(cpu.ema.averaged(), gpu.ema.averaged(), strict=True):
        assert torch.equal(a, b.cpu())
    cpu.fit()
    assert (run / "global_step_3").is_dir()


def test_prompts_without_attributes_are_named(flow_workspace, tmp_path, capsys):
    rows = [{"prompt": "a cat", "data_source": "mine", "reward_model": {"ground_truth": "cat"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mine.parquet")
    args = _args(flow_workspace, tmp_path / "run", f"data.train_files={tmp_path / 'mine.parquet'}")
    assert cli_main(["train-flow", *args]) == 2
    assert "must hold the attributes" in capsys.readouterr().err


def test_flow_grpo_keys_translate(flow_workspace, tmp_path):
    cfg = load_flow_config(None, [
        *_args(flow_workspace, tmp_path / "r"), "sample.noise_level=0.5", "train.clip_range=2e-4",
        "train.learning_rate=3e-4", "sample.num_image_per_prompt=4", "train.beta=0.04",
        "train.ema=true", "sample.sde_window_size=2", "sample.sde_window_range=[0,4]",
    ])  # fmt: skip
    assert (cfg.sampler.noise_level, cfg.actor.clip_range, cfg.actor.optim.lr) == (0.5, 2e-4, 3e-4)
    assert (cfg.sampler.n, cfg.actor.beta, cfg.actor.ema) == (4, 0.04, True)
    assert (cfg.sampler.sde_steps, cfg.sampler.sde_window_range) == (2, [0, 4])
    full = load_flow_config(
        None, [*_args(flow_workspace, tmp_path / "r"), "sample.sde_window_size=0"]
    )
    assert full.sampler.sde_steps is None  # Flow-GRPO's 0: an SDE on every step
    data = flow_workspace / "data"
    notices: list[str] = []
    cfg = load_flow_config(None, [
        *_args(flow_workspace, tmp_path / "r"), "data.val_files=null", f"dataset={data}",
        "train.clip_range_lt=1e-5", "train.clip_range_gt=2e-5", "train.adam_epsilon=1e-8",
        f"save_dir={tmp_path / 'saved'}", "prompt_fn=geneval", "train.timestep_shift=3.0",
    ], notices=notices)  # fmt: skip
    assert (cfg.data.train_files, cfg.data.val_files) == (str(data), None)  # val set: kept
    assert (cfg.actor.clip_range_low, cfg.actor.clip_range_high) == (1e-5, 2e-5)
    assert cfg.trainer.default_local_dir == str(tmp_path / "saved")
    said = " ".join(notices)
    assert "train.adam_epsilon" in said and "prompt_fn='geneval' changes nothing" in said
    assert "train.timestep_shift=3.0 changes nothing" in said
    # Flow-GRPO's dataset directory holds both splits: it is the validation prompts too
    args = [a for a in _args(flow_workspace, tmp_path / "r") if not a.startswith("data.")]
    cfg = load_flow_config(None, [*args, f"dataset={data}"])
    assert cfg.data.train_files == cfg.data.val_files == str(data)
    with pytest.raises(ConfigError, match=r"reward_fn.geneval=1.0: lmrl train-flow trains on one"):
        load_flow_config(None, [*args, f"dataset={data}", "reward_fn.geneval=1.0"])
    cfg = load_flow_config(None, [
        *_args(flow_workspace, tmp_path / "r"), "use_lora=true", "mixed_precision=bf16",
        "train.adam_beta2=0.99", "resolution=16", "sample.global_std=true", "train.batch_size=4",
        "num_checkpoint_limit=3", "seed=7", "sample.train_batch_size=8", "train.cfg=true",
    ])  # fmt: skip
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.resolution) == (32, None, 16)
    assert cfg.model.mixed_precision.param_dtype == "bfloat16"
    assert cfg.actor.optim.betas == [0.9, 0.99] and cfg.actor.global_std
    assert (cfg.actor.micro_batch_size, cfg.trainer.max_ckpt_to_keep, cfg.trainer.seed) == (4, 3, 7)


def test_eval_scores_an_image_run_with_another_reward(flow_workspace, tmp_path, capsys):
    """``lmrl train-flow`` ends with its before/after and logs the prompt fidelity beside a
    reward of another kind; ``lmrl eval RUN reward.name=...`` scores the last checkpoint's
    images with any reward and writes only their grid."""
    run = tmp_path / "run"
    args = _args(flow_workspace, run, "trainer.total_training_steps=2", "trainer.logger=[jsonl]",
                 "reward.name=brightness", "trainer.val_images_per_prompt=1")  # fmt: skip
    assert cli_main(["train-flow", *args]) == 0
    out = capsys.readouterr().out
    assert "before -> after:" in out and "val/shapes/reward/mean: " in out
    assert "val/shapes/fidelity/score" in out and "train reward (first/last 3 steps)" in out
    lines = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    steps = [m for m in lines if "critic/score/mean" in m]
    assert all(f"flow/fidelity/{c}" in steps[0] for c in ("score", "colour", "shape"))
    logged = (run / "metrics.jsonl").read_text()
    evaluate = ["eval", str(run), "reward.name=geneval", "trainer.val_images_per_prompt=2"]
    assert cli_main(evaluate) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checkpoint"] == str(run / "global_step_2")
    assert 0 <= report["val/shapes/reward/mean"] <= 1 and "val/shapes/check/shape" in report
    assert report["images"] == str(run / "eval" / "global_step_2-geneval.png")
    assert (run / "metrics.jsonl").read_text() == logged  # the run's own files are untouched
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["global_step_2-geneval.png"]
    assert cli_main(["eval", str(run), "reward.name=nope"]) == 2
    assert "not a built-in image reward" in capsys.readouterr().err


def test_the_fast_flow_demo_runs_end_to_end(tmp_path, capsys):
    assert cli_main(["demo", "--task", "flow", "--fast", "--out", str(tmp_path / "demo")]) == 0
    summary = json.loads((tmp_path / "demo" / "demo.json").read_text())
    from PIL import Image

    grids = Image.open(tmp_path / "demo" / "run" / "samples" / "step_0.png")
    pair = Image.open(tmp_path / "demo" / "before_after.png")  # prompts, before, gap, after
    assert pair.size == (200 + 2 * grids.width + 8, grids.height)
    assert (tmp_path / "demo" / "run" / "plot.png").is_file()
    assert 0 <= summary["val_reward_before"] <= 1 and 0 <= summary["val_reward_after"] <= 1
    assert summary["val_steps"] == [0, 2]
    assert list(summary["val"]) == ["reward", "colour", "count", "position", "shape"]
    for values in summary["val"].values():
        assert len(values) == 2 and all(0 <= v <= 1 for v in values)
    # the reward is the mean of the four checks (geneval), at every validation
    checks = [summary["val"][c] for c in ("colour", "count", "position", "shape")]
    assert summary["val"]["reward"] == pytest.approx(
        [sum(c) / 4 for c in zip(*checks, strict=True)]
    )
    out = capsys.readouterr().out
    assert "validation reward" in out and "position" in out


def test_pretrain_flow_writes_a_model_train_flow_loads(flow_workspace, tmp_path, capsys):
    from lmrl.flow.image_model import ImageFlow

    images = flow_workspace / "data" / "images.parquet"
    out = tmp_path / "model"
    assert cli_main(["pretrain-flow", str(images), "--out", str(out), "--steps", "2"]) == 0
    assert isinstance(ImageFlow.load(out), ImageFlow)
    assert cli_main(["pretrain-flow", str(tmp_path / "none.parquet"), "--out", str(out)]) == 2
    assert "lmrl tasks shapes" in capsys.readouterr().err


def test_the_flow_program_runs_over_parts_a_test_may_replace(flow_workspace, tmp_path):
    """``build_flow`` hands the program its parts; a fake reward swapped in drives the update:
    a reward that ranks the images of each prompt gives every group spread and a policy
    gradient, a constant one gives zero advantages and a zero policy loss."""
    import dataclasses

    class Ranked:
        def __init__(self, constant: bool) -> None:
            self.constant, self.calls = constant, 0

        def score(self, images, prompts, metadata):
            self.calls += 1
            b = images.shape[0]
            scores = torch.ones(b) if self.constant else torch.arange(b, dtype=torch.float32)
            return scores, {"fake": torch.full((b,), 0.5)}, {"reward/errors": 0.0}

    args = _args(flow_workspace, tmp_path / "run", "trainer.total_training_steps=1")
    parts = build_flow(load_flow_config(None, args))
    for constant in (False, True):
        reward = Ranked(constant)
        trainer = FlowTrainer(dataclasses.replace(parts, reward=reward))
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        metrics = trainer.step()
        assert reward.calls == 1 and metrics["flow/check/fake"] == 0.5
        assert metrics["flow/zero_spread_groups"] == (1.0 if constant else 0.0)
        if constant:
            assert metrics["actor/pg_loss"] == 0.0
        else:
            assert metrics["actor/pg_loss"] != 0.0
            after = trainer.model.state_dict()
            assert any(not torch.equal(before[k], v) for k, v in after.items())


def test_a_lora_run_exports_the_merged_model(flow_workspace, tmp_path):
    from lmrl.flow.image_model import ImageFlow

    run = tmp_path / "run"
    trainer = flow_trainer(
        _args(
            flow_workspace,
            run,
            "model.lora_rank=4",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "actor.optim.lr=1e-2",
        )
    )
    trainer.fit()
    exported = ImageFlow.load(run / "final")  # a plain image model: LoRA merged
    merged = trainer.model.merge_and_unload().state_dict()
    assert exported.state_dict().keys() == merged.keys()
    assert all(torch.allclose(exported.state_dict()[k], v) for k, v in merged.items())
    base = ImageFlow.load(flow_workspace / "model").state_dict()
    assert any(not torch.equal(base[k], v) for k, v in exported.state_dict().items())


def test_a_reward_that_scores_every_image_alike_is_said(flow_workspace, tmp_path, caplog):
    """A saturated reward (every image of every prompt 1.0): the gradient is 0, and the run
    says so once, with train-flow's own keys."""
    import logging

    reward = tmp_path / "flat.py"
    reward.write_text("def flat(images, prompts, metadata):\n    return [1.0] * len(prompts)\n")
    args = _args(flow_workspace, tmp_path / "run", "trainer.total_training_steps=5",
                 f"reward.path={reward}", "reward.name=flat", "trainer.test_freq=-1",
                 "trainer.save_freq=-1", "trainer.val_before_train=false")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lmrl"):
        history = flow_trainer(args).fit()
    assert all(m["critic/score/zero_spread_frac"] == 1.0 for m in history)
    said = [r.getMessage() for r in caplog.records if "scored all alike" in r.getMessage()]
    assert len(said) == 1 and "sampler.n" in said[0] and "filter_groups" not in said[0]
