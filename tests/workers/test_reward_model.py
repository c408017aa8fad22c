"""Model-based rewards: a one-label sequence classifier scores (prompt, response) pairs, added
to the rule reward at the last response token (or alone), locally and in a run."""

from __future__ import annotations

import json

import pytest
import torch

from lmrl.batch import Batch
from lmrl.config import load_config
from lmrl.errors import ModelError
from lmrl.models import build_tiny_model, build_tiny_reward_model, load_tokenizer
from lmrl.models.reward_model import RewardModel, load_reward_model
from lmrl.workers.reward import RewardWorker

TEXTS = [("12+3=", "15"), ("7*6=", "42 is it"), ("abc", "")]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"), seed=3)


@pytest.fixture(scope="module")
def tokenizer(rm_dir):
    return load_tokenizer(rm_dir)


def rollout(tokenizer) -> Batch:
    """Left-padded prompts, right-padded responses, as the engine lays them out."""
    P = max(len(tokenizer(p)["input_ids"]) for p, _ in TEXTS)
    T = max(len(tokenizer(r)["input_ids"]) for _, r in TEXTS) or 1
    pad = tokenizer.pad_token_id
    prompts, responses, pm, rm = [], [], [], []
    for p, r in TEXTS:
        pi, ri = tokenizer(p)["input_ids"], tokenizer(r)["input_ids"]
        prompts.append([pad] * (P - len(pi)) + pi)
        pm.append([False] * (P - len(pi)) + [True] * len(pi))
        responses.append(ri + [pad] * (T - len(ri)))
        rm.append([True] * len(ri) + [False] * (T - len(ri)))
    prompts, responses = torch.tensor(prompts), torch.tensor(responses)
    response_mask = torch.tensor(rm)
    attention = torch.cat([torch.tensor(pm), response_mask], 1)
    return Batch({
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention,
    })  # fmt: skip


def direct_scores(rm_dir, tokenizer) -> torch.Tensor:
    """Each pair alone, unpadded, through the classifier's own forward."""
    model = load_reward_model(str(rm_dir))
    out = []
    for p, r in TEXTS:
        ids = torch.tensor([tokenizer(p + r)["input_ids"]])
        out.append(model(input_ids=ids).logits[0, 0])
    return torch.stack(out)


def test_scores_equal_a_forward_of_each_pair_alone(rm_dir, tokenizer):
    scores = RewardModel(load_reward_model(str(rm_dir)))(rollout(tokenizer))
    want = direct_scores(rm_dir, tokenizer)
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)
    assert scores.std() > 0.01  # three different texts, three different scores


def test_another_tokenizer_re_encodes_the_text(rm_dir, tokenizer):
    model = load_reward_model(str(rm_dir))
    retok = RewardModel(model, tokenizer=tokenizer, policy_tokenizer=tokenizer, micro_batch_size=2)
    scores = retok(rollout(tokenizer))
    # the byte tokenizer has a chat template: the pair is a user turn and an assistant turn
    for (p, r), got in zip(TEXTS, scores, strict=True):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
        )
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        torch.testing.assert_close(got, model(input_ids=ids).logits[0, 0], atol=1e-5, rtol=1e-5)


def test_rule_and_model_scores_add_at_the_last_response_token(rm_dir, tokenizer):
    class Rules:
        def __call__(self, batch):
            from lmrl.rewards.result import RewardResult

            scores = torch.zeros(batch["response_mask"].shape)
            scores[:, 0] = 1.0  # the test's own placement; the worker adds at the last token
            return RewardResult(scores, {"score": scores.sum(-1).double().numpy()}, {"n": 3.0})

        def close(self):
            pass

    batch = rollout(tokenizer)
    model = RewardModel(load_reward_model(str(rm_dir)))
    rm = model(batch)
    out = RewardWorker(Rules(), model, coef=0.5)(batch)
    lengths = batch["response_mask"].sum(-1)
    for i, n in enumerate(lengths.tolist()):
        want = torch.zeros(batch["responses"].shape[1])
        want[0] += 1.0
        want[max(n - 1, 0)] += 0.5 * rm[i]
        torch.testing.assert_close(out.token_level_scores[i], want)
    assert out.extras["rm_score"].tolist() == pytest.approx(rm.tolist())
    alone = RewardWorker(None, model, coef=2.0)(batch)
    torch.testing.assert_close(alone.token_level_scores.sum(-1), 2.0 * rm)


def test_loading_errors_name_the_problem(tmp_path, rm_dir):
    with pytest.raises(ModelError, match="num_labels=1"):
        load_reward_model(str(build_tiny_model(tmp_path / "lm")))  # a causal LM, not a scorer
    with pytest.raises(ModelError):
        load_reward_model(str(tmp_path / "missing"))


def test_config_keys_and_verl_spelling(rm_dir):
    base = ["model.path=/m", "data.train_files=/d.parquet"]
    cfg = load_config(None, [*base, "reward_model.enable=true",
                             f"reward_model.model.path={rm_dir}",
                             "reward_model.micro_batch_size_per_gpu=4",
                             "reward_model.max_length=256"])  # fmt: skip
    assert cfg.reward_model.enable and cfg.reward_model.model.path == str(rm_dir)
    assert (cfg.reward_model.micro_batch_size, cfg.reward_model.max_length) == (4, 256)
    from lmrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"reward_model\.model\.path"):
        load_config(None, [*base, "reward_model.enable=true"])


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_run_is_rewarded_by_the_model(
    rm_dir, tiny_workspace, tiny_overrides_rm, tmp_path, backend
):
    """End to end, in one process and scored on 2 Ray workers (each loads the model)."""
    from lmrl.trainer import Trainer, build_run

    extra = []
    if backend == "ray":
        pytest.importorskip("ray")
        extra = ["trainer.backend=ray", "resources.n_gpus_per_node=2", "resources.num_cpus=2"]
    run_dir = tmp_path / "rm-run"
    cfg = load_config(None, tiny_overrides_rm(tiny_workspace, run_dir,
        "reward_model.enable=true", f"reward_model.model.path={rm_dir}",
        "reward_model.rule_reward=false", "trainer.logger=[jsonl]", *extra))  # fmt: skip
    trainer = Trainer(build_run(cfg), cfg.trainer)
    trainer.fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/rm_score/mean" in r for r in rows if "critic/score/mean" in r)
    batch = trainer.last_batch
    want = RewardModel(load_reward_model(str(rm_dir)))(batch)
    torch.testing.assert_close(batch["token_level_scores"].sum(-1), want, atol=1e-5, rtol=1e-5)
    assert batch["token_level_scores"].abs().sum() > 0  # the digits rule alone scores 0 here
