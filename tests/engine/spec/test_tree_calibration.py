"""The greedy temperature fit recovers the temperature that generated its labels, and a miscalibrated
guess has a worse likelihood (the fit can fail: a fixed tau of 1 is a negative control)."""

from __future__ import annotations

import pytest
import torch

from service.engine.spec.tree_calibration import fit_greedy_temperature, greedy_nll


@pytest.mark.parametrize("tau", [0.1, 0.3, 1.0, 2.5])
def test_the_fit_recovers_the_temperature_its_labels_were_drawn_at(tau):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 64, generator=gen) * 2
    labels = torch.multinomial((logits / tau).softmax(-1), 1, generator=gen)[:, 0]
    fitted = fit_greedy_temperature(logits, labels)
    assert fitted == pytest.approx(tau, rel=0.1)
    if abs(tau - 1.0) > 0.5:  # the uncalibrated head explains its labels worse
        assert greedy_nll(logits, labels, 1.0) > greedy_nll(logits, labels, fitted) + 0.01


def test_no_positions_leave_the_head_as_it_is():
    assert fit_greedy_temperature(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)) == 1.0
