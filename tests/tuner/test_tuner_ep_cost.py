"""The modelled objective with expert parallelism: dispatch bytes from request spans enter the cost
(dispatch + combine) only when the tuner is told the server's EP size."""

from __future__ import annotations

import pytest

from otel import attributes as a
from service.types import Drafter, ModelInfo
from tests.cli.test_grpc_cli import run_cli
from tuner.loop.assemble import cost_model
from tuner.measurement.spans import request_sample
from tuner.measurement.window import WindowStats

INFO = ModelInfo("torch", "m", "d", 4, 64, 8, 1, 100, 512, 8, (Drafter.MODEL,), (), 1000, 0.005)


def span(dispatch_bytes: int | None) -> dict:
    attrs = {a.SPEC_POLICY_ID: "s/1", a.SPEC_VERIFY_STEPS: 10, a.SPEC_COMMITTED_TOKENS: 20,
             a.COST_VERIFY_SECONDS: 0.1, a.MOE_UNIQUE_EXPERTS_MEAN: (10.0, 12.0, 14.0, 16.0)}
    if dispatch_bytes is not None:
        attrs[a.MOE_EP_DISPATCH_BYTES] = dispatch_bytes
    return {"name": "text_completion m", "attributes": attrs}


@pytest.mark.parametrize(("ep_size", "dispatch", "extra"), [(4, 40_000, 2 * 40_000), (0, 40_000, 0), (4, None, 0)],
                         ids=["ep-on", "ep-off", "no-attribute"])
def test_modelled_cost_adds_both_all_to_all_legs_only_with_an_ep_size(ep_size, dispatch, extra):
    stats = WindowStats("s/1")
    stats.add(request_sample(span(dispatch)))
    stats.add(request_sample(span(dispatch)))
    cost = cost_model(INFO, fixed_bytes_per_pass=0, ep_size=ep_size)
    weights = 2 * 10 * (10 + 12 + 14 + 16) * INFO.expert_bytes  # two requests x 10 passes x experts
    assert stats.modelled_bytes_per_token(cost) == pytest.approx((weights + 2 * extra) / 40)
    assert stats.user_attrs(cost, 0.005)["ep_dispatch_bytes_per_token"] == (2 * (dispatch or 0)) / 40


def test_a_negative_ep_size_exits_2(capsys):
    code, _, err = run_cli(capsys, "tune", "--server", "127.0.0.1:1", "--otlp-listen", "127.0.0.1:0",
                           "--ep-size", "-1")
    assert code == 2 and "--ep-size must be >= 1" in err and len(err.strip().splitlines()) == 1
