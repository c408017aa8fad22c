"""Registry, masked reductions and ``agg_loss``: hand-worked values and invariances."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from lmrl.algos.agg import LOSS_AGG_MODES, AggNorm, agg_loss
from lmrl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from lmrl.algos.registry import Registry

# ------------------------------------------------------------------- registry


def test_registry_register_get_and_errors():
    reg = Registry("widget")

    @reg.register("alpha")
    def alpha():
        return 1

    assert reg.get("alpha") is alpha
    assert "alpha" in reg and "beta" not in reg
    assert reg.names() == ["alpha"]
    with pytest.raises(ValueError, match="already registered"):
        reg.register("alpha")(lambda: 2)
    with pytest.raises(ValueError, match=r"unknown widget 'beta'; valid names: alpha"):
        reg.get("beta")


def test_registry_aliases_cannot_be_shadowed():
    reg = Registry("widget")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("low_var_kl")(lambda: 0)  # an alias of k3 in the one alias table


# ------------------------------------------------------------------ masked ops

X = torch.tensor([[1.0, 2.0, math.nan], [4.0, math.inf, 6.0]])
M = torch.tensor([[True, True, False], [True, False, True]])


def test_masked_sum_mean_ignore_nan_and_inf_outside_mask():
    assert masked_sum(X, M) == 13.0
    assert masked_mean(X, M) == 13.0 / 4
    torch.testing.assert_close(masked_mean(X, M, dim=-1), torch.tensor([1.5, 5.0]))
    torch.testing.assert_close(masked_sum(X, M.float(), dim=0), torch.tensor([5.0, 2.0, 6.0]))
    assert masked_mean(X, torch.zeros_like(M)) == 0.0  # empty mask: 0, not NaN


def test_masked_var_is_unbiased_and_whiten_normalizes():
    values = [1.0, 2.0, 4.0, 6.0]
    expected_var = torch.tensor(values).var(unbiased=True)
    torch.testing.assert_close(masked_var(X, M), expected_var)
    torch.testing.assert_close(
        masked_var(X, M, unbiased=False), torch.tensor(values).var(unbiased=False)
    )
    w = masked_whiten(X, M)
    assert torch.all(w[~M] == 0)
    torch.testing.assert_close(masked_mean(w, M), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(masked_var(w, M), torch.tensor(1.0), atol=1e-5, rtol=0)
    kept_mean = masked_whiten(X, M, shift_mean=False)
    torch.testing.assert_close(masked_mean(kept_mean, M), torch.tensor(13.0 / 4))
    single = masked_whiten(torch.tensor([[3.0, 9.0]]), torch.tensor([[True, False]]))
    assert torch.equal(single, torch.zeros(1, 2))  # one valid value: 0, not NaN


# -------------------------------------------------------------------- agg_loss

L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
LM = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("token-sum", 7.0),
        ("seq-mean-token-sum", (3 + 4) / 2),  # the empty third row is not a sequence
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 + 4) / 3),  # divided by the constant T = 3
    ],
)
def test_agg_loss_hand_values(mode, expected):
    torch.testing.assert_close(agg_loss(L, LM, mode), torch.tensor(expected))


def test_agg_loss_scale_factor_and_dp_size():
    norm = AggNorm(loss_scale_factor=10.0, dp_size=2)
    torch.testing.assert_close(agg_loss(L, LM, "seq-mean-token-sum-norm", norm), torch.tensor(1.4))
    torch.testing.assert_close(agg_loss(L, LM, "token-mean", norm), torch.tensor(14.0 / 3))


def test_agg_loss_bad_input():
    with pytest.raises(ValueError, match=r"loss_agg_mode.*token-mean"):
        agg_loss(L, LM, "token-avg")
    with pytest.raises(ValueError, match="loss_mask"):
        agg_loss(L, LM[:, :2], "token-mean")
    with pytest.raises(ValueError, match="loss_mat"):
        agg_loss(L[0], LM[0], "token-mean")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(LOSS_AGG_MODES), pieces=st.integers(1, 5))
def test_agg_loss_micro_batch_invariance(seed, mode, pieces):
    """Splitting a mini-batch into micro-batches (trimmed to their own lengths) with the global
    normalizers gives the same loss and the same gradient as the whole."""
    gen = torch.Generator().manual_seed(seed)
    batch, length = 7, 5
    x = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) < 0.6
    weights = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    norm = AggNorm.from_mask(mask, loss_scale_factor=length)

    whole_x = x.clone().requires_grad_()
    whole = agg_loss(whole_x * weights, mask, mode)  # its own counts are the global ones
    whole.backward()

    split_x = x.clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for rows in torch.arange(batch).tensor_split(pieces):
        # each micro-batch trimmed to its own longest response, as the workers do
        width = int(mask[rows].any(0).nonzero().max()) + 1 if mask[rows].any() else 1
        part = agg_loss((split_x * weights)[rows, :width], mask[rows, :width], mode, norm)
        part.backward()
        total += part.detach()
    torch.testing.assert_close(total, whole.detach())
    torch.testing.assert_close(split_x.grad, whole_x.grad)


def test_public_names_are_not_shadowed_by_submodules():
    """Importing a submodule binds its name on the package: no export may share one."""
    import importlib
    import types

    from lmrl import algos

    for module in ("advantages", "agg", "kl", "logprob", "losses", "masked", "registry",
                   "rollout_correction", "value"):  # fmt: skip
        importlib.import_module(f"lmrl.algos.{module}")
    for name in algos.__all__:
        assert not isinstance(getattr(algos, name), types.ModuleType), name
    assert algos.policy_losses.get("vanilla") is not None
