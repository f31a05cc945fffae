"""The scoring of `moespec bench tuner --scenario whatif`: which measured trial counts as reaching the
reference pick / target, when, and the paired savings over seeds, on hand-made event sequences with
known answers."""

from __future__ import annotations

from service.types import Drafter, DraftPolicy
from tuner.bench_whatif import FirstMeasured, summarise
from tuner.space import policy_key
from tuner.tuning import EventKind, TunerEvent

PLAIN = DraftPolicy(draft_length=0)
MODEL_4_T0 = DraftPolicy(Drafter.MODEL, 4, 0.0)
NGRAM_3 = DraftPolicy(Drafter.NGRAM, 3)


def finished(policy: DraftPolicy, state: str = "COMPLETE", role: str = "search", message: str = "") -> TunerEvent:
    return TunerEvent(EventKind.TRIAL_FINISHED, role=role, policy=policy, state=state, message=message)


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


def test_summary_pairs_the_seeds_and_censors_runs_that_never_got_there() -> None:
    def run(seed: int, hint: bool, to_pick, to_target=(1, 1)) -> dict:
        return {"seed": seed, "hint": hint, "baselines": True, "to_reference_pick": to_pick, "to_target": to_target}

    runs = [run(0, False, (6, 10)), run(0, True, (4, 6)), run(1, False, None), run(1, True, (9, 16)),
            run(2, False, (3, 4)), run(2, True, (5, 8))]
    by_goal = {e["goal"]: e for e in summarise(runs, budget=10)}
    pick = by_goal["to_reference_pick"]
    assert pick["without_never"] == 1 and pick["with_never"] == 0
    assert pick["without_trials"] == [6, 11, 3]  # never -> budget + 1, a lower bound
    assert pick["saved_trials"] == [2, -2] and pick["saved_switches"] == [4, -4]  # seed 1 not paired
    assert by_goal["to_target"]["saved_trials"] == [0, 0, 0]
