"""`moespec whatif --cost-profile`: a profile of the recording's own machine prices the passes as the
recording did; another machine's profile scales them; another geometry carries unions over as a share
of top-k; the command line reads the profile and refuses a broken one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.bench.verify_cost.fit import CostModel
from service.bench.verify_cost.geometry import Geometry
from service.bench.verify_cost.profile import FORMAT, CostProfile, load_profile
from service.recording import StepRecorder
from service.types import Drafter, ModelInfo, StepRecord
from service.whatif.predict import predict
from service.whatif.profile_pricing import ProfilePricing

L, E, M, H = 2, 16, 2, 8
TRUE = CostModel(fixed=1e-3, per_expert=2e-4, per_position=5e-4)  # the recording machine's verify cost


def step(k: int, drafted: int, accepted: int) -> StepRecord:
    """Layer 0 alternates {0, 1} / {2, 3} by position (any window of 2+ positions has union 4, whatever
    its offset), layer 1 always picks {8, 9}: a window's union depends on its size alone, so the
    recording's per-size mean timings and a per-window profile see the same costs."""
    w = drafted + 1
    topk = (tuple((0, 1) if p % 2 == 0 else (2, 3) for p in range(w)), tuple((8, 9) for _ in range(w)))
    union = (2 if w == 1 else 4, 2)
    verify = TRUE.seconds(w, sum(union) / L)
    return StepRecord(
        drafter=Drafter.MODEL, draft_length=k, draft_temperature=0.0, policy_id="p", drafted=drafted,
        accepted=accepted, committed=accepted + 1,
        accepted_per_position=tuple(i < accepted for i in range(drafted)), window=w, unique_experts=union,
        shared_experts=1, unique_experts_bound=min(E, w * M), draft_seconds=3e-4 * drafted, verify_seconds=verify,
        decode_step_equivalents=verify / TRUE.seconds(1, M), topk_ids=topk, window_ids=tuple(range(w)),
        pairwise_overlap_mean=(0.0, 2.0), pairwise_overlap_min=(0.0, 2.0))


def requests() -> list[list[StepRecord]]:
    # Every window size 1..5 at least 10 times, so the run prices each size at its own mean.
    pattern = [(4, 0), (4, 1), (4, 2), (4, 3), (4, 4), (3, 3), (2, 2), (1, 1), (0, 0)]
    return [[step(4, d, a) for d, a in pattern] for _ in range(12)]


def own_profile(scale: float = 1.0, geometry: Geometry | None = None) -> CostProfile:
    g = geometry or Geometry("recorded", hidden=H, experts=E, top_k=M, expert_intermediate=4, shared_intermediate=4,
                             layers=L)
    model = CostModel(TRUE.fixed * scale, TRUE.per_expert * scale, TRUE.per_position * scale)
    return CostProfile(g, L, model, "cpu", model.seconds(1, M))


def test_the_recording_s_own_machine_as_a_profile_predicts_what_its_timings_do() -> None:
    without = predict(requests(), M)
    with_profile = predict(requests(), M, profile=ProfilePricing(own_profile(), M, E))
    assert with_profile.cost_profile is not None and without.cost_profile is None
    for a, b in zip(without.predictions, with_profile.predictions, strict=True):
        assert b.verify_seconds_per_step == pytest.approx(a.verify_seconds_per_step, rel=1e-9)
        assert b.verify_seconds_per_step_truncated == pytest.approx(a.verify_seconds_per_step_truncated, rel=1e-9)
        assert b.seconds_per_committed_token == pytest.approx(a.seconds_per_committed_token, rel=1e-9)
        assert b.draft_seconds_per_step == a.draft_seconds_per_step  # draft time stays the recording's


def test_a_machine_twice_as_slow_doubles_the_verify_part_only() -> None:
    own = predict(requests(), M, profile=ProfilePricing(own_profile(), M, E))
    slow = predict(requests(), M, profile=ProfilePricing(own_profile(2.0), M, E))
    for a, b in zip(own.predictions, slow.predictions, strict=True):
        assert b.verify_seconds_per_step == pytest.approx(2 * a.verify_seconds_per_step, rel=1e-9)
        assert b.draft_seconds_per_step == a.draft_seconds_per_step


def test_another_geometry_carries_unions_over_as_a_share_of_top_k_within_the_window_range() -> None:
    big = Geometry("big", hidden=64, experts=128, top_k=8, expert_intermediate=8, shared_intermediate=0, layers=48)
    pricing = ProfilePricing(own_profile(geometry=big), M, E)
    assert not pricing.same_geometry
    assert pricing.union(5, 4.0) == 16.0  # 4 of k=2 -> 16 of k=8
    assert pricing.union(1, 2.0) == 8.0
    assert pricing.union(2, 7.0) == 16.0  # clipped to w * k
    # 48 layers priced by a profile benched over 2: 24x the benched pass.
    assert pricing.seconds(5, 4.0) == pytest.approx(24 * TRUE.seconds(5, 16.0))


def write_profile(path: Path, profile: CostProfile) -> None:
    path.write_text(json.dumps({"format": FORMAT, "device": profile.device, "geometry": profile.geometry.to_json(),
                                "layers_benched": profile.layers_benched, "model": profile.model.to_json(),
                                "plain_step_seconds": profile.plain_step_seconds}))


def test_whatif_cli_prices_with_the_profile_and_refuses_a_broken_one(tmp_path: Path) -> None:
    recording = tmp_path / "steps.jsonl"
    info = ModelInfo("torch", "synthetic", "", L, E, M, 1, 100, 64, 8, (Drafter.MODEL,), (), 1, TRUE.seconds(1, M))
    recorder = StepRecorder(recording, info, hidden_size=H)
    for r in requests():
        recorder.write(r)
    recorder.close()
    profile_path = tmp_path / "profile.json"
    write_profile(profile_path, own_profile(3.0))
    assert load_profile(profile_path).model == own_profile(3.0).model
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "service.cli", "whatif", str(recording), "--cost-profile",
                           str(profile_path), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "priced by the cost profile" in done.stdout
    result = json.loads((out / "whatif.json").read_text())
    expected = predict(requests(), M, profile=ProfilePricing(own_profile(3.0), M, E))
    assert result["cost_profile"].startswith("recorded (E=16, k=2")
    assert [p["verify_seconds_per_step"] for p in result["predictions"]] == pytest.approx(
        [p.verify_seconds_per_step for p in expected.predictions], rel=1e-12)
    profile_path.write_text(json.dumps({"format": FORMAT, "device": "cpu"}))
    bad = subprocess.run([sys.executable, "-m", "service.cli", "whatif", str(recording), "--cost-profile",
                          str(profile_path)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--cost-profile" in bad.stderr and "malformed cost profile" in bad.stderr
