"""``lmrl train-flow`` on a diffusers StableDiffusion3Pipeline directory: a tiny SD3 pipeline
built here from configs (two 2-layer CLIPs, a 1-layer T5, a 2-block SD3 transformer, a 2-level
VAE with 16 latent channels; random weights, ``save_pretrained``) and loaded through
``model.path`` as a user's SD3.5 directory is."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from lmrl.cli import main as cli_main
from lmrl.config.flow import load_flow_config
from lmrl.errors import ModelError
from lmrl.flow.pipelines import SD3Pipeline
from lmrl.flow.random_sd3 import build_random_sd3
from lmrl.trainer.flow import FlowTrainer, build_flow, read_prompts

GENEVAL_ROWS = [
    {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
    {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}],
     "prompt": "a photo of a red dog"},
    {"tag": "counting", "include": [{"class": "cup", "count": 2}], "prompt": "two cups"},
]  # fmt: skip


def build_tiny_sd3(out, t5: bool = True):
    """A StableDiffusion3Pipeline of tiny random parts, saved in ``out``."""
    return build_random_sd3(out, "tiny", t5=t5)


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    """The tiny pipeline and Flow-GRPO's prompt files as they ship."""
    root = tmp_path_factory.mktemp("sd3")
    build_tiny_sd3(root / "sd3")
    (root / "pickscore").mkdir()
    (root / "pickscore" / "train.txt").write_text("a cat\na red dog\n\ntwo cups\na blue bird\n")
    (root / "pickscore" / "test.txt").write_text("a cat\na dog\n")
    (root / "geneval").mkdir()
    lines = [json.dumps(r) for r in GENEVAL_ROWS + GENEVAL_ROWS[:1]]
    (root / "geneval" / "train_metadata.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _args(root, run, *extra):
    return [
        f"model.path={root / 'sd3'}", "model.resolution=16", "model.max_sequence_length=8",
        f"data.train_files={root / 'pickscore' / 'train.txt'}",
        f"data.val_files={root / 'pickscore' / 'test.txt'}",
        f"trainer.default_local_dir={run}", "trainer.logger=[]", "trainer.device=cpu",
        "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=2",
        "trainer.val_images_per_prompt=2", "data.train_batch_size=2", "sampler.n=2",
        "sampler.num_steps=3", "sampler.val_num_steps=2", "actor.micro_batch_size=2",
        "actor.clip_range=0.2", "actor.optim.lr=1e-2", "reward.name=brightness",
        "model.lora_rank=4", "model.lora_alpha=8", *extra,
    ]  # fmt: skip


def flow_trainer(args) -> FlowTrainer:
    return FlowTrainer(build_flow(load_flow_config(None, args)))


def test_flow_grpo_prompt_files_load_as_they_ship(sd3, tmp_path):
    text = read_prompts(str(sd3 / "pickscore" / "train.txt"))
    assert [r["prompt"] for r in text] == ["a cat", "a red dog", "two cups", "a blue bird"]
    assert {r["data_source"] for r in text} == {"pickscore"}
    rows = read_prompts(str(sd3 / "geneval" / "train_metadata.jsonl"))
    assert [r["prompt"] for r in rows[:3]] == [r["prompt"] for r in GENEVAL_ROWS]
    assert rows[1]["metadata"]["include"] == [{"class": "dog", "count": 1, "color": "red"}]
    assert rows[0]["data_source"] == "geneval" and "attributes" not in rows[0]


def test_an_sd3_directory_loads_through_model_path(sd3, tmp_path):
    parts = build_flow(load_flow_config(None, _args(sd3, tmp_path / "run", "model.lora_rank=0")))
    pipe = parts.pipeline
    assert isinstance(pipe, SD3Pipeline) and pipe.pipe.text_encoder_3 is not None
    assert parts.image_shape == (16, 8, 8)  # 16 px through the 2x VAE: 8x8 latents
    assert parts.sampler.shift == 3.0  # the scheduler's (sampler.shift=null)
    cond = pipe.cond([{"prompt": "a cat"}, {"prompt": "a dog"}, {"prompt": "a cat"}])
    # CLIP's 77 tokens + T5's 8, then the pooled row; width max(32 text, 64 pooled)
    assert cond.shape == (3, 77 + 8 + 1, 64)
    assert torch.equal(cond[0], cond[2]) and not torch.equal(cond[0], cond[1])
    assert set(pipe._cache) == {"a cat", "a dog"}  # each prompt encoded once
    embeds, _, pooled, _ = pipe.pipe.encode_prompt(
        "a dog", None, None, do_classifier_free_guidance=False, max_sequence_length=8
    )
    assert torch.equal(cond[1, :-1, :32], embeds[0]) and torch.equal(cond[1, -1], pooled[0])
    assert not cond[1, :-1, 32:].any()
    uncond = pipe.uncond(cond)
    assert uncond.shape == cond.shape and torch.equal(uncond[0], pipe._encode(""))
    pixels = pipe.decode(torch.randn(2, 16, 8, 8))
    assert pixels.shape == (2, 3, 16, 16) and pixels.min() >= 0 and pixels.max() <= 1


def test_an_sd3_directory_without_t5_encodes_its_part_as_zeros(tmp_path):
    """SD3 may ship without T5 (``text_encoder_3`` null): its tokens are zeros."""
    build_tiny_sd3(tmp_path / "no_t5", t5=False)
    pipe = SD3Pipeline(tmp_path / "no_t5", torch.device("cpu"), max_sequence_length=8)
    cond = pipe.cond([{"prompt": "a cat"}])
    assert cond.shape == (1, 77 + 8 + 1, 64) and pipe.pipe.text_encoder_3 is None
    assert not cond[0, 77:-1].any() and cond[0, :77].any()


def test_sd3_sampling_log_probs_are_the_sde_steps_density(sd3, tmp_path):
    """Flow-GRPO-Fast's window (steps 1-2 of 4 SDE, the others ODE) with guidance 4.5 and a
    negative prompt: every SDE step's log-prob is the Gaussian density of the reverse SDE
    written out here from the transformer called directly (diffusers' own encodings)."""
    from torch.distributions import Normal

    args = _args(sd3, tmp_path / "run", "sampler.num_steps=4", "sampler.sde_start=1",
                 "sampler.sde_steps=2", "sampler.guidance_scale=4.5",
                 "model.negative_prompt=blurry", "model.lora_rank=0")  # fmt: skip
    parts = build_flow(load_flow_config(None, args))
    rows = [{"prompt": "a cat"}, {"prompt": "a red dog"}]
    cond = parts.pipeline.cond(rows)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(2, *parts.image_shape, generator=gen)
    batch = parts.sampler.sample(
        parts.model, cond, noise, uncond=parts.pipeline.uncond(cond), generator=gen
    )
    assert batch["step_mask"][0].tolist() == [False, True, True, False]
    assert (batch["log_probs"][:, [0, 3]] == 0).all()
    pipe = parts.pipeline.pipe
    pos, neg, pooled, neg_pooled = pipe.encode_prompt(
        ["a cat", "a red dog"], None, None, negative_prompt=["blurry"] * 2,
        do_classifier_free_guidance=True, max_sequence_length=8,
    )  # fmt: skip
    a, cap = 0.7, float(parts.sampler.times[1])
    for j in (1, 2):
        x, t = batch["latents"][:, j], batch["timesteps"][:, j]
        dt = (batch["next_timesteps"][:, j] - t).view(-1, 1, 1, 1)
        with torch.no_grad():
            v_c, v_u = (
                pipe.transformer(hidden_states=x, timestep=t * 1000, encoder_hidden_states=e,
                                 pooled_projections=p, return_dict=False)[0]
                for e, p in ((pos, pooled), (neg, neg_pooled))
            )  # fmt: skip
        v = v_u + 4.5 * (v_c - v_u)
        tb = t.view(-1, 1, 1, 1)
        sigma = a * torch.sqrt(tb / (1 - tb))
        mean = x + (v + sigma**2 / (2 * tb) * (x + (1 - tb) * v)) * dt
        density = Normal(mean, sigma * torch.sqrt(-dt)).log_prob(batch["next_latents"][:, j])
        expected = density.mean((1, 2, 3))
        assert torch.allclose(batch["log_probs"][:, j], expected, atol=1e-4), j
        assert t[0] < cap or j > 0


def test_train_flow_on_an_sd3_directory_trains_lora_and_writes_grids(sd3, tmp_path):
    """``lmrl train-flow`` as a user runs it: GenEval's metadata reach the reward, the LoRA
    trains, validation writes grids, final/ is the adapter in PEFT's format."""
    from peft import PeftModel
    from PIL import Image

    reward = tmp_path / "reward.py"
    reward.write_text(
        "def includes(images, prompts, metadata):\n"
        "    assert all('include' in m for m in metadata), metadata\n"
        "    return images.mean((1, 2, 3))\n"
    )
    run = tmp_path / "run"
    geneval = sd3 / "geneval" / "train_metadata.jsonl"
    args = _args(sd3, run, f"data.train_files={geneval}", f"data.val_files={geneval}",
                 f"reward.path={reward}", "reward.name=includes", "reward.max_error_fraction=0",
                 "actor.beta=0.1", "sampler.guidance_scale=4.5",
                 "trainer.logger=[jsonl]")  # fmt: skip
    assert cli_main(["train-flow", *args]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    steps = [m for m in lines if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2] and "actor/kl_loss" in steps[0]
    assert all(m["reward/errors"] == 0 for m in steps)
    # the prompt fidelity beside the user's reward: the red dog's colour and count are judged
    assert "flow/fidelity/score" in steps[0] and "flow/fidelity/shape" not in steps[0]
    assert {"val/geneval/fidelity/colour", "val/geneval/fidelity/count"} <= set(lines[0])
    for step in (0, 2):  # one row per validation prompt, 2 images of 16 px, border 1, scale 4
        grid = Image.open(run / "samples" / f"step_{step}.png")
        assert grid.size == (2 * 18 * 4, 4 * 18 * 4)
    assert "val/geneval/reward/mean" in lines[0]
    saved = load_file(run / "global_step_2" / "model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # the adapters, not the base weights
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # they trained
    from diffusers import SD3Transformer2DModel

    base = SD3Transformer2DModel.from_pretrained(sd3 / "sd3" / "transformer")
    adapted = PeftModel.from_pretrained(base, run / "final")
    trained = {k.replace(".default", ""): v for k, v in adapted.state_dict().items()}
    for key, value in saved.items():
        assert torch.equal(trained[key.removeprefix("transformer.").replace(".default", "")],
                           value), key  # fmt: skip
    # final/ starts another run's LoRA (Flow-GRPO's train.lora_path), its rank must be this one's
    again = flow_trainer(_args(sd3, tmp_path / "again", "train.lora_path=" + str(run / "final")))
    start = again.model.state_dict()
    assert all(torch.equal(start[key], value) for key, value in saved.items())
    with pytest.raises(ModelError, match="adapter of rank 4 on"):
        flow_trainer(_args(sd3, tmp_path / "r8", f"model.lora_path={run / 'final'}",
                           "model.lora_rank=8"))  # fmt: skip


def test_an_sd3_lora_run_with_ema_resumes_bitwise_exact(sd3, tmp_path):
    extra = ("actor.ema=true", "actor.ema_every=1", "trainer.total_training_steps=3",
             "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.val_before_train=false")  # fmt: skip
    whole = flow_trainer(_args(sd3, tmp_path / "whole", *extra))
    whole.fit()

    class Stop(Exception):
        pass

    cut = flow_trainer(_args(sd3, tmp_path / "cut", *extra))
    step = cut.step

    def step_then_die():
        if cut.global_step == 2:  # dies in step 3, after the step-2 checkpoint
            raise Stop
        return step()

    cut.step = step_then_die
    with pytest.raises(Stop):
        cut.fit()
    resumed = flow_trainer(_args(sd3, tmp_path / "cut", *extra))
    assert resumed.global_step == 2
    resumed.fit()
    expected = load_file(tmp_path / "whole" / "global_step_3" / "model.safetensors")
    actual = load_file(tmp_path / "cut" / "global_step_3" / "model.safetensors")
    assert expected.keys() == actual.keys() and all("lora_" in k for k in expected)
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    assert resumed.ema.calls == whole.ema.calls == 3
    for a, b in zip(whole.ema.averaged(), resumed.ema.averaged(), strict=True):
        assert torch.equal(a, b)


def _sdxl(root):
    (root / "sdxl" / "unet").mkdir(parents=True)
    index = {
        "_class_name": "StableDiffusionXLPipeline",
        "unet": ["diffusers", "UNet2DConditionModel"],
    }
    (root / "sdxl" / "model_index.json").write_text(json.dumps(index))
    return [f"model.path={root / 'sdxl'}"]


def _text_model(root):
    (root / "lm").mkdir()
    (root / "lm" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (root / "lm" / "model.safetensors").write_bytes(b"")
    return [f"model.path={root / 'lm'}"]


def _no_text_encoder(root, sd3):
    shutil.copytree(sd3 / "sd3", root / "partial")
    shutil.rmtree(root / "partial" / "text_encoder_2")
    return [f"model.path={root / 'partial'}"]


def _prompt_file(root, name, text):
    (root / name).write_text(text)
    return [f"data.train_files={root / name}"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda r, s: _sdxl(r), "holds a diffusers StableDiffusionXLPipeline; lmrl train-flow"),
        (lambda r, s: _text_model(r), "holds a qwen2 model, not an image pipeline"),
        (_no_text_encoder, "text_encoder_2 (CLIPTextModelWithProjection) is missing"),
        (lambda r, s: _prompt_file(r, "p.csv", "prompt\na cat\n"), "not a prompt format"),
        (lambda r, s: _prompt_file(r, "p.jsonl", '{"text": "a cat"}\n'),
         'line 1: not a JSON object with a "prompt" string'),
        (lambda r, s: ["model.resolution=10"], "model.resolution=10 must be a multiple of 4"),
        (lambda r, s: ["model.resolution=128"], "more than the transformer's positions cover"),
        (lambda r, s: ["model.target_modules=[to_q,attn.nowhere]"],
         "'attn.nowhere' matches no module of the SD3 transformer"),
        (lambda r, s: ["reward.name=geneval"], "reward.name=geneval can judge nothing of these"),
        (lambda r, s: [f"model.lora_path={r}"], "not a PEFT adapter directory"),
        (lambda r, s: [f"data.train_files={r}"], "no train.txt or train_metadata.jsonl"),
        (lambda r, s: ["mixed_precision=fp8"], "mixed_precision='fp8': expected one of no, bf16"),
    ],
)  # fmt: skip
def test_bad_sd3_input_is_a_one_line_error_and_writes_nothing(sd3, tmp_path, capsys, make, message):
    run = tmp_path / "run"
    code = cli_main(["train-flow", *_args(sd3, run), *make(tmp_path, sd3)])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert message in err and "Traceback" not in err
    assert not run.exists()


def test_a_bf16_lora_run_keeps_the_frozen_base_in_bf16(sd3, tmp_path):
    """Under bf16 compute the LoRA's frozen base is stored in bf16 (half the memory of fp32
    masters) and the adapters in fp32; a step trains them."""
    trainer = flow_trainer(_args(sd3, tmp_path / "run", "mixed_precision=bf16",
                                 "trainer.val_before_train=false"))  # fmt: skip
    params = dict(trainer.model.named_parameters())
    lora = {n for n, p in params.items() if p.requires_grad}
    assert lora and all("lora_" in n and params[n].dtype == torch.float32 for n in lora)
    assert {p.dtype for n, p in params.items() if n not in lora} == {torch.bfloat16}
    before = {n: params[n].detach().clone() for n in lora}
    metrics = trainer.step()
    assert math.isfinite(metrics["actor/pg_loss"])
    assert any(not torch.equal(before[n], params[n]) for n in lora)


@pytest.mark.gpu
def test_train_flow_at_sd35_medium_shape_on_a_gpu(tmp_path):
    """``lmrl train-flow`` on a random pipeline of SD3.5 Medium's shape (2.24B transformer, SD3's
    VAE) as a user runs it: LoRA 32 on the joint attention, bf16 compute over fp32 masters,
    CFG 4.5, Flow-GRPO-Fast's window, EMA, 512 px. On-policy the first update clips nothing,
    the adapters train, the grids are written, and the checkpoint loads back into a new run."""
    build_random_sd3(tmp_path / "sd35m", "sd35-medium")
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("a red cat\na blue dog\na green cup\na cube\n")
    (prompts / "test.txt").write_text("a red cat\n")
    run = tmp_path / "run"
    args = [
        f"model.path={tmp_path / 'sd35m'}", "model.resolution=512", f"data.train_files={prompts}",
        f"data.val_files={prompts}", f"trainer.default_local_dir={run}", "trainer.logger=[jsonl]",
        "trainer.device=cuda", "trainer.total_training_steps=2", "trainer.save_freq=2",
        "trainer.test_freq=2", "trainer.val_images_per_prompt=2", "data.train_batch_size=2",
        "sampler.n=4", "sampler.num_steps=10", "sampler.sde_steps=2", "sampler.val_num_steps=10",
        "sampler.guidance_scale=4.5", "actor.micro_batch_size=4", "actor.clip_range=1e-4",
        "actor.optim.lr=3e-4", "actor.ema=true", "actor.ema_every=1", "reward.name=brightness",
        "use_lora=true", "mixed_precision=bf16",
    ]  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    trainer = flow_trainer(args)
    history = trainer.fit()
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"SD3.5-M shape, 8 images at 512 px: {history[-1]['timing_s/step']:.1f} s a step, "
          f"peak {peak:.1f} GiB")  # fmt: skip
    assert history[0]["actor/pg_clipfrac"] < 0.05  # bf16 on-policy: the ratio stays ~1
    saved = load_file(run / "global_step_2" / "model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)
    assert (run / "samples" / "step_2.png").is_file() and (run / "final").is_dir()
    again = flow_trainer([*args, "trainer.total_training_steps=3"])  # resumes at step 2
    assert again.global_step == 2
    state = again.model.state_dict()
    assert all(torch.equal(state[k].cpu(), v) for k, v in saved.items())
