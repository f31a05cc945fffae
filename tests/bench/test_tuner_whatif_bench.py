"""`moespec bench tuner --scenario whatif`: the length-only search space it runs the tuner in, which
measured trial counts as reaching the target and when (hand-made events with known answers, and a
whole study against a fake server that stops at its first target trial), and the paired savings
and prediction accuracy over seeds."""

from __future__ import annotations

import dataclasses
import io

import optuna
import pytest

from service.bench.tuner_whatif import FirstMeasured, SwitchCountingAdmin, predictions, run_study
from service.bench.tuner_whatif_report import one_position_markdown, one_position_passes, prediction_errors, summarise
from service.recording import StepRecorder, read_recording
from service.types import Drafter, DraftPolicy
from tests.support.tuner_fixtures import SyntheticTraffic, model_info
from tests.tuner.test_tuner_whatif import RecordingServer, cost
from tests.whatif.test_whatif import H, info, synthetic_step
from tuner.loop import study as st
from tuner.loop.assemble import TuneSettings
from tuner.loop.events import EventKind, TunerEvent
from tuner.loop.sampler import InitialDesign
from tuner.loop.space import LengthOnly, SearchSpace, policy_key
from tuner.measurement.collector import SpanCollector
from tuner.measurement.spans import request_sample
from tuner.measurement.window import WindowSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)

PLAIN = DraftPolicy(draft_length=0)
MODEL_4_T0 = DraftPolicy(Drafter.MODEL, 4, 0.0)
NGRAM_3 = DraftPolicy(Drafter.NGRAM, 3)


def finished(policy: DraftPolicy, state: str = "COMPLETE", role: str = "search", message: str = "") -> TunerEvent:
    return TunerEvent(EventKind.TRIAL_FINISHED, role=role, policy=policy, state=state, message=message)


@pytest.mark.parametrize("restrict", [LengthOnly(Drafter.MODEL, 0.0), LengthOnly(Drafter.NGRAM)],
                         ids=lambda r: r.label())
def test_a_length_only_space_proposes_every_length_of_its_one_drafter_and_nothing_else(restrict) -> None:
    full = SearchSpace.from_model_info(model_info())
    assert full.tune_drafter and full.tune_temperature  # the full space tunes all three
    space = restrict.restrict(full)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    proposed = set()
    for _ in range(80):
        trial = study.ask()
        proposed.add(policy_key(space.suggest(trial, "p")))
        assert set(trial.params) == {"draft_length"}  # nothing else is asked
        study.tell(trial, 1.0)
    expected = {policy_key(PLAIN)} | {policy_key(DraftPolicy(restrict.drafter, k, restrict.draft_temperature))
                                      for k in range(1, 9)}
    assert proposed == expected
    # The initial designs and a stored trial's params stay inside it too.
    for policy in space.corners() + space.baselines():
        rebuilt = space.policy_from_params(space.params_of(policy), "p")
        assert policy_key(rebuilt) in expected
    assert policy_key(space.corners()[1]) == policy_key(DraftPolicy(restrict.drafter, 8, restrict.draft_temperature))


def test_a_length_only_space_refuses_a_drafter_the_server_does_not_offer() -> None:
    space = SearchSpace.from_model_info(model_info(drafters=(Drafter.MODEL,)))
    with pytest.raises(ValueError, match="'ngram' is not offered"):
        LengthOnly(Drafter.NGRAM).restrict(space)


def test_first_of_counts_search_trials_and_switches_until_a_target_trial_completed() -> None:
    seen = FirstMeasured()
    events = [(finished(PLAIN), 1), (finished(DraftPolicy(Drafter.MODEL, 4, 0.5)), 3),  # T=0.5: not the T=0 point
              (finished(NGRAM_3, state="PRUNED"), 5),  # pruned: not measured in full
              (finished(NGRAM_3, role="remeasure"), 6),  # not a search trial
              (TunerEvent(EventKind.WHATIF, policy=DraftPolicy(Drafter.MODEL, 4, 0.07),
                          message="model k=4 T=0.07 predicted 1.0 ms/tok: enqueued"), 7),
              (finished(DraftPolicy(Drafter.MODEL, 4, 0.07)), 8),  # T <= 0.1: the T=0 point, a hint's trial
              (finished(NGRAM_3), 10)]
    for event, switches in events:
        seen.on_event(event, switches)
    assert seen.trials == 5  # the re-measure is not a search trial; the pruned one is
    assert seen.first_of({policy_key(MODEL_4_T0)}) == (4, 8)
    assert seen.first_of({policy_key(NGRAM_3)}) == (5, 10)
    assert seen.first_of({policy_key(NGRAM_3), policy_key(PLAIN)}) == (1, 1)
    assert seen.first_of({policy_key(DraftPolicy(Drafter.NGRAM, 2))}) is None
    assert seen.hints == 1
    assert seen.first_from_hint({policy_key(MODEL_4_T0)}) is True
    assert seen.first_from_hint({policy_key(NGRAM_3)}) is False
    assert seen.first_from_hint({policy_key(DraftPolicy(Drafter.NGRAM, 2))}) is None


def length_study(tmp_path, hinted: bool, target: DraftPolicy) -> tuple[dict, optuna.Study]:
    """A length-only model-drafter study (T=0, corners first) against the fake server, whose steps
    accept one draft each (so the replay predicts k'=1 best), run by the bench until `target`."""
    path = tmp_path / "steps.jsonl"
    recorder = StepRecorder(path, info(), hidden_size=H)
    server = RecordingServer(recorder, accepted=1)
    collector = SpanCollector(request_sample)
    storage = st.open_storage(f"sqlite:///{tmp_path / 't.db'}")
    name = "whatif" if hinted else "tpe"
    settings = TuneSettings(study_name=name, trials=9, tuner_id="t", seed=0, remeasure_top=0,
                            window=WindowSpec(min_tokens=64, min_steps=8, max_seconds=2.0),
                            poll_seconds=0.01, policy_check_seconds=0.05, initial_design=InitialDesign.CORNERS,
                            restrict=LengthOnly(Drafter.MODEL, 0.0), whatif_recording=path if hinted else None)
    admin = SwitchCountingAdmin(server, "fake:0", retry_seconds=0.2, sleep=lambda s: None)
    with SyntheticTraffic(server, collector.on_spans, cost):
        run = run_study(admin, collector, storage, settings, {policy_key(target)}, io.StringIO())
    recorder.close()
    return run, optuna.load_study(study_name=name, storage=storage)


def test_the_bench_stops_a_study_at_its_first_target_trial_and_counts_trials_and_switches(tmp_path) -> None:
    model_1 = DraftPolicy(Drafter.MODEL, 1, 0.0)
    run, study = length_study(tmp_path, hinted=True, target=model_1)
    # Corners (plain, k=8, k=2), then the hint from k=8 (k'=1 predicted best), queued behind k=2.
    assert run["order"] == ["plain", "model k=8 T=0.00", "model k=2 T=0.00", "model k=1 T=0.00"]
    assert run["to_target"] == (4, run["switches"]) and run["measured_trials"] == 4
    assert run["target_from_hint"] is True and run["hints_enqueued"] == 1
    # Stopped there: no trial was asked after the target's (a hint's WAITING copy may remain).
    asked = [t for t in study.trials if t.state is not optuna.trial.TrialState.WAITING]
    assert len(asked) == 4 and asked[-1].user_attrs.get("whatif_of") == 1
    assert run["switches"] >= 4  # every measured trial serves its candidate at least once
    made = {p["measured"]: p for p in run["predictions"]}
    long = made["model k=8 T=0.00"]
    assert {k: v for k, v in long.items() if k != "predicted"} == {
        "trial": 1, "measured": "model k=8 T=0.00", "predicted_best": "model k=1 T=0.00", "hint": True,
        "in_target": True}
    assert list(long["predicted"]) == ["plain"] + [f"model k={k} T=0.00" for k in range(1, 9)]
    assert min(long["predicted"], key=long["predicted"].get) == "model k=1 T=0.00"
    assert made["model k=2 T=0.00"]["predicted_best"] == "model k=1 T=0.00"


def test_without_the_hint_the_same_study_predicts_nothing_and_takes_tpe_s_order(tmp_path) -> None:
    # The negative control of the test above: same seed and settings, no recording.
    run, _ = length_study(tmp_path, hinted=False, target=DraftPolicy(Drafter.MODEL, 1, 0.0))
    assert run["order"][:3] == ["plain", "model k=8 T=0.00", "model k=2 T=0.00"]
    assert run["predictions"] == [] and run["hints_enqueued"] == 0 and run["target_from_hint"] is False
    assert run["to_target"][0] == run["measured_trials"] >= 4


def test_summary_pairs_the_seeds_counts_saved_cost_tied_and_censors_runs_that_never_got_there() -> None:
    def run(seed: int, hint: bool, to_target, predictions=()) -> dict:
        return {"seed": seed, "hint": hint, "start": "corners", "to_target": to_target,
                "target_from_hint": bool(predictions) and hint, "predictions": list(predictions)}

    good, bad = {"hint": True, "in_target": True}, {"hint": True, "in_target": False}
    kept = {"hint": False, "in_target": True}  # k itself predicted best: no hint queued
    runs = [run(0, False, (6, 10)), run(0, True, (4, 6), [good, kept]), run(1, False, None),
            run(1, True, (9, 16), [bad]), run(2, False, (3, 4)), run(2, True, (5, 8), [bad, good]),
            run(3, False, (2, 3)), run(3, True, (2, 3))]
    [e] = summarise(runs + [dict(r, start="none") for r in runs[:2]], budget=9)[:1]
    assert e["start"] == "corners" and e["seeds"] == [0, 1, 2, 3]
    assert e["without_never"] == 1 and e["with_never"] == 0
    assert e["without_trials"] == [6, 10, 3, 2]  # never -> budget + 1, a lower bound
    assert e["saved_trials"] == [2, -2, 0] and e["saved_switches"] == [4, -4, 0]  # seed 1 not paired
    assert (e["seeds_saved"], e["seeds_cost"], e["seeds_tied"]) == (1, 1, 1)
    assert (e["hints"], e["hints_in_target"]) == (4, 2)
    assert (e["predictions"], e["predictions_in_target"]) == (5, 3)
    assert e["target_from_hint"] == 3
    assert [x["start"] for x in summarise(runs + [dict(r, start="none") for r in runs[:2]], budget=9)] == \
        ["corners", "none"]


def test_predictions_count_each_measured_trial_once_and_judge_the_predicted_length_against_the_target() -> None:
    space = LengthOnly(Drafter.NGRAM).restrict(SearchSpace.from_model_info(model_info()))
    dist = {"draft_length": optuna.distributions.IntDistribution(0, 8)}

    def trial(k: int, **attrs) -> optuna.trial.FrozenTrial:
        return optuna.trial.create_trial(params={"draft_length": k}, distributions=dist, value=1.0, user_attrs=attrs)

    trials = [trial(0), trial(8, whatif_best_length=3), trial(3, whatif_best_length=3),
              trial(8, whatif_best_length=3, duplicate_of=1),  # a reused result: not a second prediction
              trial(5, whatif_best_length=2, whatif_predicted={"0": 2.0, "2": 1.0, "1": 3.0})]
    for number, t in enumerate(trials):
        t.number = number
    made = predictions(trials, space, target={policy_key(DraftPolicy(Drafter.NGRAM, 3))})
    assert [{k: v for k, v in p.items() if k != "predicted"} for p in made] == [
        {"trial": 1, "measured": "ngram k=8", "predicted_best": "ngram k=3", "hint": True, "in_target": True},
        {"trial": 2, "measured": "ngram k=3", "predicted_best": "ngram k=3", "hint": False, "in_target": True},
        {"trial": 4, "measured": "ngram k=5", "predicted_best": "ngram k=2", "hint": True, "in_target": False}]
    assert made[2]["predicted"] == {"plain": 2.0, "ngram k=1": 3.0, "ngram k=2": 1.0}


def test_prediction_errors_compare_each_predicted_length_with_its_own_reference_cost() -> None:
    runs = [{"predictions": [{"predicted": {"plain": 2.0, "ngram k=1": 3.0}}, {"predicted": {"plain": 1.5}}]},
            {"predictions": []}]
    errors = prediction_errors(runs, {"ngram k=1": 2.0, "plain": 1.0, "ngram k=2": 1.0})
    assert errors == {"ngram k=1": [0.5], "plain": [1.0, 0.5]}  # the reference's order; k=2 never predicted


def test_one_position_passes_are_grouped_by_the_recorded_policy_beside_the_startup_step(tmp_path) -> None:
    def step(k: int, drafted: int, seconds: float, drafter: Drafter = Drafter.MODEL):
        return dataclasses.replace(synthetic_step(max(k, 1), drafted, 0), draft_length=k, drafter=drafter,
                                   verify_seconds=seconds)

    path = tmp_path / "steps.jsonl"
    recorder = StepRecorder(path, info(), hidden_size=H)
    recorder.write([step(0, 0, 1.0), step(0, 0, 3.0), step(0, 0, 2.5)])  # plain: median 2.5
    recorder.write([step(8, 8, 9.0), step(8, 0, 5.0), step(8, 0, 4.0)])  # one wide pass (not counted), two single
    recorder.write([step(3, 0, 7.0, Drafter.NGRAM)])
    recorder.close()
    passes = one_position_passes(read_recording(path))
    assert passes["median_verify_seconds"] == {"plain": 2.5, "model k=8": 4.5, "ngram k=3": 7.0}
    assert passes["passes"] == {"plain": 3, "model k=8": 2, "ngram k=3": 1}
    assert passes["startup_decode_step_seconds"] == info().decode_step_seconds
    table = "\n".join(one_position_markdown(passes))
    assert "| model k=8 | 2 | 4500.00 | 1.80 |" in table
