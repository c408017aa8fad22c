"""`WeightEMA`: the average Flow-GRPO validates with, by hand."""

from __future__ import annotations

import pytest
import torch

from lmrl.flow import WeightEMA


def test_the_average_follows_diffusers_warm_up_every_nth_step_and_swaps_in_and_out():
    p = torch.nn.Parameter(torch.zeros(3))
    ema = WeightEMA([p], decay=0.9, every=2)
    values = [torch.full((3,), float(v)) for v in (1, 2, 3, 4)]
    for v in values:  # an optimizer step sets p, then the EMA is told
        p.data.copy_(v)
        ema.step()
    # updated at calls 2 and 4: the first copies p (decay 0), the second uses min(0.9, 2/11)
    d = 2 / 11
    expected = d * values[1] + (1 - d) * values[3]
    assert ema.updates == 2
    torch.testing.assert_close(ema.averaged()[0], expected)
    with ema.applied():
        torch.testing.assert_close(p.detach(), expected)
    assert torch.equal(p.detach(), values[3])  # the trained weights are back

    again = WeightEMA([torch.nn.Parameter(torch.zeros(3))], decay=0.9, every=2)
    again.load_state_dict(ema.state_dict())
    assert again.calls == 4 and again.updates == 2
    torch.testing.assert_close(again.averaged()[0], expected)


def test_the_decay_caps_the_warm_up():
    p = torch.nn.Parameter(torch.zeros(1))
    ema = WeightEMA([p], decay=0.5, every=1)
    for v in range(1, 40):
        p.data.fill_(float(v))
        ema.step()
    # long after the warm-up the decay is 0.5: the average trails the last value by ~1
    assert ema.averaged()[0].item() == pytest.approx(38.0, abs=1e-4)


@pytest.mark.parametrize(("decay", "every"), [(1.0, 8), (-0.1, 8), (0.9, 0)])
def test_bad_settings_are_refused(decay, every):
    with pytest.raises(ValueError, match="decay must be in"):
        WeightEMA([torch.nn.Parameter(torch.zeros(1))], decay=decay, every=every)
