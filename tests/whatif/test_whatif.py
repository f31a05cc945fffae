"""What-if replay: known answers on synthetic recordings, the file round trip, the CLI, and the
union recount of a shorter window against what the engine reports when it really runs it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from service.recording import RecordingError, StepRecorder, read_recording
from service.routing.expert_parallel import make_placement
from service.types import Drafter, DraftPolicy, GenerationRequest, ModelInfo, SamplingParams, StepRecord
from service.whatif.fit import fit_cost_curve
from service.whatif.predict import predict
from tests.support.engine_helpers import heldout_prompts, make_engine

L, E, M, H = 2, 16, 2, 8
C0, C_POS, C_EXPERT = 1e-3, 5e-4, 2e-4  # the synthetic run's true verify cost curve
DRAFT_PER_TOKEN = 3e-4


def curve(w: int, union_mean: float) -> float:
    return C0 + C_POS * w + C_EXPERT * union_mean


def union0(w: int) -> int:
    return 2 if w == 1 else 4


def synthetic_step(k: int, drafted: int, accepted: int, layer1: tuple[int, int] = (8, 9)) -> StepRecord:
    """Layer 0: positions 0 and 1 pick {0, 1} and {2, 3}, later ones {0, 1} again (union0(w), and a
    recount from the window's last positions would differ); layer 1: every position picks `layer1`."""
    w = drafted + 1
    topk = (tuple((2 * p, 2 * p + 1) if p < 2 else (0, 1) for p in range(w)), tuple(layer1 for _ in range(w)))
    union = (union0(w), 2)
    # The recording keeps routed ids, and a loaded step's pairwise overlap is recounted from them.
    pairs = [[len(set(a) & set(b)) for i, a in enumerate(layer) for b in layer[i + 1:]] or [len(layer[0])]
             for layer in topk]
    plain = curve(1, M)
    verify = curve(w, sum(union) / L)
    return StepRecord(
        drafter=Drafter.MODEL, draft_length=k, draft_temperature=0.0, policy_id="p", drafted=drafted,
        accepted=accepted, committed=accepted + 1,
        accepted_per_position=tuple(i < accepted for i in range(drafted)), window=w, unique_experts=union,
        shared_experts=1, unique_experts_bound=min(E, w * M), draft_seconds=DRAFT_PER_TOKEN * drafted,
        verify_seconds=verify, decode_step_equivalents=verify / plain, topk_ids=topk, window_ids=tuple(range(w)),
        pairwise_overlap_mean=tuple(sum(p) / len(p) for p in pairs), pairwise_overlap_min=tuple(min(p) for p in pairs),
    )


def info() -> ModelInfo:
    return ModelInfo("torch", "synthetic", "", L, E, M, 1, 100, 64, 8, (Drafter.MODEL,), (), 1, curve(1, M))


def test_replay_committed_counts_have_known_answers() -> None:
    # k=3; outcomes per position: [1, 1, 0] then [0] -> a k'=1 run commits 4 tokens in 3 steps
    # (it stops at the rejection the k-run found at position 2), truncation says (2 + 1) / 2.
    request = (synthetic_step(3, 3, 2), synthetic_step(3, 3, 0))
    result = predict([request], M)
    by_k = {p.draft_length: p for p in result.predictions}
    assert [p.draft_length for p in result.predictions] == [0, 1, 2, 3]
    assert by_k[0].committed_per_step == 1.0
    assert by_k[1].committed_per_step == pytest.approx(4 / 3)
    assert by_k[1].committed_per_step_truncated == pytest.approx(1.5)
    assert by_k[2].committed_per_step == pytest.approx(4 / 2)
    assert by_k[3].committed_per_step == pytest.approx(4 / 2)  # k' = k reproduces the run
    assert by_k[3].committed_per_step_spread == 0  # nothing untested: every draw is the same
    assert by_k[1].acceptance_per_position == (0.5,)
    assert by_k[3].acceptance_per_position == (0.5, 0.5, 0.0)  # of the 2 steps that drafted each


def test_untested_bonus_positions_follow_the_run_s_continuation_rate() -> None:
    # Every window fully accepted: P(accept | previous accepted) = 1, so the untested bonus
    # positions count as accepted and k'=1 commits 2 per step, k'=2 three.
    request = tuple(synthetic_step(2, 2, 2) for _ in range(4))
    result = predict([request], M)
    assert [p.committed_per_step for p in result.predictions] == [1.0, 2.0, 3.0]


def test_unions_costs_and_ep_views_have_known_answers() -> None:
    request = (synthetic_step(3, 3, 1, (8, 9)), synthetic_step(3, 3, 0, (10, 12)), synthetic_step(3, 1, 1))
    placement = make_placement(2, L, E)  # rank 0 holds experts 0..7, rank 1 8..15
    result = predict([request], M, placement, ep_token_bytes=H)
    c = result.curve
    for p in result.predictions:
        k = p.draft_length
        windows = [min(3, k) + 1, min(3, k) + 1, min(1, k) + 1]
        assert p.window_mean == pytest.approx(sum(windows) / 3)
        assert p.unique_experts_mean == pytest.approx((sum(union0(w) for w in windows) / 3, 2.0))
        expected_verify = sum(curve(w, (union0(w) + 2) / 2) for w in windows) / 3
        assert p.verify_seconds_per_step == pytest.approx(expected_verify, rel=1e-6)  # the fit recovers the truth
        drafts = [min(3, k), min(3, k), min(1, k)]
        assert p.draft_seconds_per_step == pytest.approx(DRAFT_PER_TOKEN * sum(drafts) / 3)
        step_seconds = p.draft_seconds_per_step + p.verify_seconds_per_step
        assert p.seconds_per_committed_token == pytest.approx(step_seconds / p.committed_per_step)
        # EP: layer 0 stays on rank 0 (experts 0..3); layer 1 always on rank 1 (off the home rank).
        assert p.ep_ranks_touched_mean == pytest.approx((1.0, 1.0))
        assert p.ep_max_rank_experts_mean == pytest.approx((sum(union0(w) for w in windows) / 3, 2.0))
        offrank_pairs = sum(M * w for w in windows) / 3
        assert p.ep_dispatch_bytes_per_token == pytest.approx(offrank_pairs * H / p.committed_per_step)
    assert c.steps == 3
    assert c.seconds(1, M) == pytest.approx(c.plain_step_seconds) == pytest.approx(curve(1, M))  # through the anchor
    assert result.measured_seconds_per_committed_token == pytest.approx(
        sum(s.seconds for s in request) / sum(s.committed for s in request))


def test_mixed_policies_are_refused() -> None:
    other = StepRecord(**{**synthetic_step(3, 3, 1).__dict__, "draft_length": 2, "drafted": 2,
                          "accepted_per_position": (True, False)})
    with pytest.raises(ValueError, match="2 policies"):
        predict([(synthetic_step(3, 3, 1), other)], M)


def test_a_recording_round_trips_through_the_file(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    recorder = StepRecorder(path, info(), hidden_size=H)
    requests = [(synthetic_step(3, 3, 2), synthetic_step(3, 3, 0)), (synthetic_step(3, 1, 1),)]
    for r in requests:
        recorder.write(r)
    recorder.close()
    recorder = StepRecorder(path, info(), hidden_size=H)  # a restarted server appends a new section
    recorder.write(requests[1])
    recorder.close()
    recording = read_recording(path)
    assert recording.header["hidden_size"] == H
    assert recording.requests == (*requests, requests[1])


def test_a_broken_recording_is_refused_with_the_line(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text('{"r": 0}\n')
    with pytest.raises(RecordingError, match="steps.jsonl:1: no 'moespec.steps' header"):
        read_recording(path)
    recorder = StepRecorder(path.with_name("ok.jsonl"), info(), hidden_size=H)
    recorder.write((synthetic_step(3, 3, 2),))
    recorder.close()
    lines = path.with_name("ok.jsonl").read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1].replace('"w":4', '"w":5'), lines[1][:40]]) + "\n")
    with pytest.raises(RecordingError, match=r"steps.jsonl:2: malformed step"):
        read_recording(path)


def test_whatif_cli_prints_the_table_and_writes_json_and_png(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    recorder = StepRecorder(path, info(), hidden_size=H)
    recorder.write((synthetic_step(3, 3, 2), synthetic_step(3, 3, 0), synthetic_step(3, 3, 1)))
    recorder.close()
    out = subprocess.run([sys.executable, "-m", "service.cli", "whatif", str(path), "--ep-size", "2",
                          "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "predicted best draft length" in out.stdout and "EP ranks / layer" in out.stdout
    data = json.loads((tmp_path / "o" / "whatif.json").read_text())
    assert [p["draft_length"] for p in data["predictions"]] == [0, 1, 2, 3]
    assert (tmp_path / "o" / "whatif.png").stat().st_size > 1000
    bad = subprocess.run([sys.executable, "-m", "service.cli", "whatif", str(path), "--ep-size", "3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "do not split into 3" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def engine():
    return make_engine(capture_topk=True)


def start_positions(prompt_len: int, steps) -> list[int]:
    starts, pos = [], prompt_len - 1
    for s in steps:
        starts.append(pos)
        pos += s.committed
    return starts


def test_union_recount_of_a_shorter_window_equals_the_engine_running_that_window(engine) -> None:
    """Greedy, model drafter at T=0: where a k'=1 or 2 run opens a window at the same position with
    the same tokens as the k=4 run's window prefix, the recount from the k=4 ids equals what the
    engine measured for its own window."""
    matched = 0
    for prompt in heldout_prompts(2):
        request = GenerationRequest(prompt=prompt, max_new_tokens=24, sampling=SamplingParams(temperature=0))
        prompt_len = len(engine.tokenizer.encode(prompt).ids)
        long = engine.generate(request, DraftPolicy(Drafter.MODEL, 4, 0.0))
        windows = {(start, s.window_ids): s for start, s in zip(start_positions(prompt_len, long.steps), long.steps,
                                                                strict=True)}
        for kp in (1, 2):
            short = engine.generate(request, DraftPolicy(Drafter.MODEL, kp, 0.0))
            assert short.token_ids == long.token_ids  # greedy: lossless at every length
            for start, s in zip(start_positions(prompt_len, short.steps), short.steps, strict=True):
                match = next((ls for (ls_start, ids), ls in windows.items()
                              if ls_start == start and ids[:s.window] == s.window_ids), None)
                if match is None:
                    continue
                ids = torch.tensor(match.topk_ids)[:, :s.window]  # [L, w', m]
                recount = tuple(len(torch.unique(layer)) for layer in ids)
                assert recount == s.unique_experts
                matched += 1
    assert matched >= 4  # the first window of each of the 4 short runs always matches (10 did here)


def test_a_failing_recording_write_is_counted_never_raised(tmp_path) -> None:
    recorder = StepRecorder(tmp_path / "steps.jsonl", info(), hidden_size=H)
    recorder.close()  # every later write fails (I/O on a closed file)
    recorder.write((synthetic_step(3, 3, 2),))
    assert recorder.errors == 1
    no_ids = dataclasses.replace(synthetic_step(3, 3, 2), topk_ids=None)
    recorder = StepRecorder(tmp_path / "other.jsonl", info(), hidden_size=H)
    recorder.write((no_ids,))
    recorder.close()
    assert recorder.errors == 1 and len(read_recording(tmp_path / "other.jsonl").requests) == 0


def test_the_cost_curve_never_keeps_a_negative_slope() -> None:
    """Window and union move together; noise that falls with the window would give the joint fit
    a negative per-position slope, which the fit must refuse (it keeps the union alone here)."""
    windows, unions, seconds = [2, 3, 4, 5], [10.0, 9.0, 14.0, 13.0], [10.5, 9.3, 13.9, 12.6]
    steps = [dataclasses.replace(synthetic_step(4, w - 1, 0), unique_experts=(int(u), int(u)), verify_seconds=s,
                                 decode_step_equivalents=0.0)
             for w, u, s in zip(windows, unions, seconds, strict=True)]
    joint = np.linalg.lstsq(np.array([[1, w, u] for w, u in zip(windows, unions, strict=True)]), seconds,
                            rcond=None)[0]
    assert joint[1] < 0  # the premise: the unconstrained fit would extrapolate downwards in window
    curve_fit = fit_cost_curve(steps, M)
    assert curve_fit.per_position == 0 and curve_fit.per_expert > 0
    assert curve_fit.per_expert == pytest.approx(np.polyfit(unions, seconds, 1)[0])


def test_draft_time_has_a_per_step_part_fitted_from_steps_that_drafted_fewer() -> None:
    per_step, per_draft = 2e-3, 3e-4
    request = tuple(dataclasses.replace(synthetic_step(4, d, 0), draft_seconds=per_step + per_draft * d)
                    for d in (4, 4, 4, 2, 4, 1))
    result = predict([request], M)
    assert result.draft_curve.per_step == pytest.approx(per_step)
    assert result.draft_curve.per_draft == pytest.approx(per_draft)
    by_k = {p.draft_length: p for p in result.predictions}
    assert by_k[0].draft_seconds_per_step == 0
    assert by_k[1].draft_seconds_per_step == pytest.approx(per_step + per_draft)  # not a quarter of a k=4 step
    assert by_k[2].draft_seconds_per_step == pytest.approx(per_step + per_draft * (2 + 2 + 2 + 2 + 2 + 1) / 6)


def test_a_window_size_the_run_has_often_enough_is_priced_at_its_own_mean() -> None:
    """12 recorded two-position passes at 5 ms: k'=1 costs 5 ms whatever the fitted line says;
    the four-position size, seen 3 times, still comes from the line."""
    slow = [dataclasses.replace(synthetic_step(3, 1, 0), verify_seconds=5e-3) for _ in range(12)]
    request = (*slow, synthetic_step(3, 3, 1), synthetic_step(3, 3, 0), synthetic_step(3, 3, 2))
    result = predict([request], M)
    assert set(result.window_seconds) == {2}
    by_k = {p.draft_length: p for p in result.predictions}
    assert by_k[1].verify_seconds_per_step_truncated == pytest.approx(5e-3)
    assert by_k[3].verify_seconds_per_step == pytest.approx((12 * 5e-3 + 3 * result.curve.seconds(4, 3.0)) / 15)
    # The k'=1 replay walks 15 two-position steps (12 + 1 + 1 + 1: the last recorded step's accepted
    # run of 2 splits after its first draft) and then the request's last token as a plain step (no
    # budget left to draft), priced on the line through the plain step: 16 steps for 18 tokens.
    assert by_k[1].replay_window_mean == pytest.approx(31 / 16)
    assert by_k[1].verify_seconds_per_step == pytest.approx((15 * 5e-3 + result.curve.seconds(1, 2.0)) / 16)


def test_the_replay_prices_the_shorter_run_s_own_steps_not_the_recorded_mix() -> None:
    """An n-gram-like run at k=4: ten steps that accept 3 of 4 drafts, each followed by a step whose
    lookup found nothing. A k'=1 run splits each accepted run into two full two-position windows,
    so per 5 tokens it pays two w=2 passes and one w=1 pass; the recorded steps truncated to k'=1
    have one w=2 pass per w=1 pass, which is too cheap a mix."""
    accepted = dataclasses.replace(synthetic_step(4, 4, 3), drafter=Drafter.NGRAM, draft_seconds=0.0)
    nothing = dataclasses.replace(synthetic_step(4, 0, 0), drafter=Drafter.NGRAM, draft_seconds=0.0)
    result = predict([(accepted, nothing) * 10], M)
    p = {x.draft_length: x for x in result.predictions}[1]
    # Layer 0 of a window starting at offset 0 picks {0..3} (union 4), at offset 2 {0, 1} (union 2);
    # layer 1 always 2 experts. Two-position passes were never recorded: priced on the fitted line;
    # ten one-position passes were: priced at their mean.
    c = result.curve
    assert result.window_seconds[1] == pytest.approx(curve(1, 2.0))
    per_five_tokens = c.seconds(2, (4 + 2) / 2) + c.seconds(2, (2 + 2) / 2) + curve(1, 2.0)
    assert p.committed_per_step == pytest.approx(5 / 3)
    assert p.replay_window_mean == pytest.approx(5 / 3)
    assert p.verify_seconds_per_step == pytest.approx(per_five_tokens / 3, rel=1e-6)
    assert p.seconds_per_committed_token == pytest.approx(per_five_tokens / 5, rel=1e-6)
    # The recorded mix (one w=2 and one w=1 pass per 5 tokens' worth of steps) would be biased low.
    recorded_mix = (c.seconds(2, 3.0) + curve(1, 2.0)) / 2
    assert p.verify_seconds_per_step_truncated == pytest.approx(recorded_mix, rel=1e-6)
    assert recorded_mix / p.committed_per_step < 0.98 * p.seconds_per_committed_token


def test_short_windows_get_the_line_of_the_run_s_own_multi_position_passes() -> None:
    """Passes after a draft pay a fixed 2 ms a plain step does not. A k=4 run whose requests end with
    shorter windows (the budget) identifies that line on its own passes: k'=1 is priced on it, not on
    the line through the plain step, which misses the fixed part."""
    overhead = 2e-3

    def step(drafted: int) -> StepRecord:
        """Layer 0: position p picks {2p, 2p+1} (union 2w); layer 1 always {8, 9}: mean union w + 1."""
        w = drafted + 1
        topk = (tuple((2 * p, 2 * p + 1) for p in range(w)), tuple((8, 9) for _ in range(w)))
        verify = curve(w, w + 1) + overhead
        return dataclasses.replace(synthetic_step(4, drafted, 0), topk_ids=topk, unique_experts=(2 * w, 2),
                                   verify_seconds=verify, decode_step_equivalents=verify / curve(1, M))

    request = tuple(step(d) for d in (4, 4, 4, 1, 4, 4, 2, 4, 3, 4, 1, 2))
    result = predict([request], M)
    line = result.speculative_curve
    assert line is not None and line.seconds(2, 3.0) == pytest.approx(curve(2, 3.0) + overhead)
    by_k = {p.draft_length: p for p in result.predictions}
    assert by_k[1].verify_seconds_per_step == pytest.approx(curve(2, 3.0) + overhead)
    assert result.curve.plain_step_seconds == pytest.approx(curve(1, M))
    assert result.curve.seconds(2, 3.0) < curve(2, 3.0) + 0.8 * overhead  # the line through the plain step
    # The same passes 2 ms *cheaper* than the synthetic line: a negative fixed part, which no pass has
    # (noise of a few off-size passes, extrapolated): refused, the line through the plain step prices them.
    overhead = -2e-3
    result = predict([tuple(step(d) for d in (4, 4, 4, 1, 4, 4, 2, 4, 3, 4, 1, 2))], M)
    assert result.speculative_curve is None
    by_k = {p.draft_length: p for p in result.predictions}
    assert by_k[1].verify_seconds_per_step == pytest.approx(result.curve.seconds(2, 3.0))


def test_an_ngram_step_costs_one_lookup_whatever_it_proposes() -> None:
    """The n-gram drafter searches the history once per step: 0.1 ms whether it proposed 4 tokens, 1
    or none (one 1.5 ms lookup, a preempted one, stays in the mean). k'=1 pays one lookup per step,
    not a quarter of a k=4 step's; k'=0 looks up nothing."""
    lookups = (1e-4, 1e-4, 1e-4, 1.5e-3, 1e-4, 0.0)  # the last step had no budget left: no lookup
    request = tuple(dataclasses.replace(synthetic_step(4, d, 0), drafter=Drafter.NGRAM, draft_seconds=t)
                    for d, t in zip((4, 1, 0, 4, 2, 0), lookups, strict=True))
    result = predict([request], M)
    by_k = {p.draft_length: p for p in result.predictions}
    assert by_k[0].draft_seconds_per_step == 0
    # The other five steps look up once each, the mean lookup (the one that found nothing included).
    assert result.draft_curve.per_step == pytest.approx(sum(lookups) / 5)
    assert by_k[1].draft_seconds_per_step == pytest.approx(sum(lookups) / 5 * 5 / 6)
    assert by_k[4].draft_seconds_per_step == pytest.approx(by_k[1].draft_seconds_per_step)
