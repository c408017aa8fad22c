"""model.mixed_precision (issue 32 §1): verl's ``fsdp_config.mixed_precision`` keys of the
actor, the reference and the critic translate onto it; two different values in one file are
one error; fp16 on a CPU is refused before any model loads."""

from __future__ import annotations

import textwrap

import pytest

from lmrl.config import ConfigError, load_config

BASE = ["model.path=/models/tiny", "data.train_files=/tmp/x.parquet"]


@pytest.mark.parametrize(
    "section",
    ["actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model", "critic"],
)
def test_verl_mixed_precision_keys_set_model_mixed_precision(section):
    notices: list[str] = []
    cfg = load_config(None, [*BASE, f"{section}.fsdp_config.mixed_precision.param_dtype=bf16",
                             f"{section}.fsdp_config.mixed_precision.reduce_dtype=fp32",
                             f"{section}.fsdp_config.mixed_precision.buffer_dtype=fp32"],
                      notices=notices)  # fmt: skip
    mp = cfg.model.mixed_precision
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == ("bf16", "fp32", "fp32")
    assert not [n for n in notices if "mixed_precision" in n]  # translated, not "changes nothing"
    # the catch-all still notices the other FSDP knobs
    load_config(None, [*BASE, "actor_rollout_ref.actor.fsdp_config.wrap_policy.x=1"],
                notices=notices)  # fmt: skip
    assert any("wrap_policy" in n for n in notices)


def test_the_actor_and_the_critic_asking_for_different_dtypes_is_one_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent("""
        actor_rollout_ref:
          actor: {fsdp_config: {mixed_precision: {param_dtype: bf16}}}
        critic:
          model: {fsdp_config: {mixed_precision: {param_dtype: fp32}}}
    """)
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, BASE)
    (message,) = err.value.errors
    assert message.startswith("model.mixed_precision.param_dtype is set twice")


@pytest.mark.parametrize(
    "overrides,key",
    [(["model.mixed_precision.param_dtype=fp16"], "model.mixed_precision.param_dtype=fp16"),
     (["model.dtype=float16"], "model.dtype=float16")],
)  # fmt: skip
def test_fp16_on_a_cpu_is_one_line(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, "trainer.device=cpu", *overrides])
    (message,) = err.value.errors
    assert message.startswith(f"{key}: float16 compute on a CPU is not supported")
    assert "\n" not in message


def test_an_unknown_dtype_names_the_choices():
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, "model.mixed_precision.param_dtype=int8"])
    assert "bfloat16" in str(err.value)
