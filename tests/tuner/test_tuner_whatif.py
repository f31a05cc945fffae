"""The tuning loop's what-if hook (`TunerConfig.whatif_recording`), fast: a fake policy server whose
synthetic requests are also written to a real step recording under the policy id they ran with,
so the tuner replays exactly what it measured. The real-server version is test_tuner_whatif_e2e.py."""

from __future__ import annotations

import dataclasses

import optuna
from optuna.trial import TrialState

from service.bench.tuner_whatif import SwitchCountingAdmin
from service.policy.traffic import TrafficArm, TrafficSplit
from service.recording import StepRecorder
from service.types import Drafter, DraftPolicy, ModelInfo
from tests.support.tuner_fixtures import FakeServer, SyntheticTraffic, model_info
from tests.whatif.test_whatif import H, info, synthetic_step
from tuner.loop import study as st
from tuner.loop.assemble import TuneSettings, assemble
from tuner.loop.events import EventKind
from tuner.loop.space import SearchSpace, policy_key
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.spans import request_sample
from tuner.measurement.window import WindowSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)

STEPS_PER_REQUEST = 4


def cost(policy: DraftPolicy) -> float:
    """Nothing far enough from plain to be pruned: every baseline completes and can give a hint."""
    return 1.0 if policy.draft_length == 0 else 0.9 + 0.01 * policy.draft_length


class RecordingServer(FakeServer):
    """Every request the synthetic traffic serves is also recorded, as `moespec serve --record-steps`
    does: its steps under the policy id it ran with. Each step accepts `accepted` of its k drafts."""

    def __init__(self, recorder: StepRecorder, accepted: int, info: ModelInfo | None = None):
        super().__init__(info)
        self.recorder, self.accepted = recorder, accepted

    def next_policy(self) -> DraftPolicy:
        policy = super().next_policy()
        k = policy.draft_length
        if k > 0:
            step = dataclasses.replace(synthetic_step(k, k, min(self.accepted, k)), policy_id=policy.policy_id)
            self.recorder.write([step] * STEPS_PER_REQUEST)
        return policy


def tune(tmp_path, *, accepted: int = 1, recording: str | None = "steps.jsonl", trials: int = 5,
         queued: tuple[DraftPolicy, ...] = (), server_info: ModelInfo | None = None):
    """`queued`: policies enqueued in a fresh study before the tuner opens it (instead of its baselines)."""
    path = tmp_path / "steps.jsonl"
    recorder = StepRecorder(path, info(), hidden_size=H)
    server = RecordingServer(recorder, accepted, server_info)
    events = []
    collector = SpanCollector(request_sample)
    settings = TuneSettings(study_name="s", trials=trials, tuner_id="t", seed=0, remeasure_top=0,
                            window=WindowSpec(min_tokens=64, min_steps=8, max_seconds=2.0),
                            poll_seconds=0.01, policy_check_seconds=0.05,
                            whatif_recording=tmp_path / recording if recording else None)
    storage = st.open_storage(f"sqlite:///{tmp_path / 't.db'}")
    if queued:
        study = optuna.create_study(storage=storage, study_name="s", direction="minimize")
        for policy in queued:
            study.enqueue_trial(SearchSpace.from_model_info(server_info or model_info()).params_of(policy))
    built = assemble(settings, storage,
                     PolicyAdmin(server, "fake:0", retry_seconds=0.2, sleep=lambda s: None), collector, events.append)
    with SyntheticTraffic(server, collector.on_spans, cost):
        built.tuner.run()
    recorder.close()
    return built.study, server, events


def label(trial) -> str:
    return policy_key(SearchSpace.from_model_info(model_info()).policy_from_params(trial.params, "")).label()


def test_a_measured_length_enqueues_the_predicted_best_shorter_one_next(tmp_path):
    # One draft accepted per step, the rest rejected: k'=1 commits as much as k=3 for less work.
    study, server, events = tune(tmp_path, accepted=1)
    trials = study.trials
    assert [label(t) for t in trials[:3]] == ["plain", "model k=3 T=1.00", "ngram k=3"]  # the baselines
    model, ngram = trials[1], trials[2]
    for measured in (model, ngram):
        assert measured.state is TrialState.COMPLETE
        assert measured.user_attrs["whatif_best_length"] == 1
        assert sorted(measured.user_attrs["whatif_predicted"]) == ["0", "1", "2", "3"]
        predicted = measured.user_attrs["whatif_predicted"]
        assert predicted["1"] == measured.user_attrs["whatif_predicted_best"] < 0.95 * predicted["3"]
        assert measured.user_attrs["whatif_recorded_steps"] >= 8
        assert measured.user_attrs["whatif_recorded_steps"] % STEPS_PER_REQUEST == 0
    # The hints were queued after the baselines and measured for real, as search trials.
    hinted = {t.user_attrs["whatif_of"]: t for t in trials if "whatif_of" in t.user_attrs}
    assert sorted(hinted) == [1, 2]
    assert label(hinted[1]) == "model k=1 T=1.00" and label(hinted[2]) == "ngram k=1"
    assert [t.number for t in hinted.values()] == [3, 4]
    for t in hinted.values():
        assert t.state is TrialState.COMPLETE and t.user_attrs["role"] == st.ROLE_SEARCH
        applied = {a.policy.policy_id for split in server.splits for a in split.arms}
        assert f"s/{t.number}" in applied  # the server really ran it
    assert sum(e.kind is EventKind.WHATIF and "enqueued" in e.message for e in events) == 2


def test_without_a_recording_nothing_is_enqueued_or_stored(tmp_path):
    # The negative control of the test above: the same study without the hook takes TPE's trials.
    study, _, events = tune(tmp_path, accepted=1, recording=None)
    assert not any("whatif_of" in t.user_attrs for t in study.trials)
    assert not any(k.startswith("whatif") for t in study.trials for k in t.user_attrs)
    assert not any(e.kind is EventKind.WHATIF for e in events)


def test_a_hint_for_an_already_measured_policy_is_not_enqueued(tmp_path):
    # Nothing accepted: the replay says plain decoding, which the first trial already measured.
    study, _, events = tune(tmp_path, accepted=0, trials=4)
    assert study.trials[1].user_attrs["whatif_best_length"] == 0
    assert not any("whatif_of" in t.user_attrs for t in study.trials)
    skipped = [e.message for e in events if e.kind is EventKind.WHATIF]
    assert skipped and all("measured in trial 0" in m for m in skipped)


def test_a_hint_for_a_policy_already_queued_is_not_queued_twice(tmp_path):
    ngram1 = DraftPolicy(Drafter.NGRAM, 1)
    study, _, events = tune(tmp_path, accepted=1, trials=3,
                            queued=(DraftPolicy(draft_length=0), DraftPolicy(Drafter.NGRAM, 8), ngram1))
    assert study.trials[1].user_attrs["whatif_best_length"] == 1
    assert [label(t) for t in study.trials[:3]] == ["plain", "ngram k=8", "ngram k=1"]
    assert not any("whatif_of" in t.user_attrs for t in study.trials)
    assert any(e.kind is EventKind.WHATIF and e.message.endswith("already queued") for e in events)


def test_a_re_proposal_of_a_hinted_policy_is_not_marked_as_hinted(tmp_path):
    # Three policies in all (plain, n-gram k=1, 2): TPE soon re-proposes the hinted one, and the
    # copy of its result must not claim a hint queued it.
    small = model_info(max_draft_length=2, drafters=(Drafter.NGRAM,), tunable=("draft_length",))
    study, _, _ = tune(tmp_path, accepted=1, trials=4, server_info=small,
                       queued=(DraftPolicy(draft_length=0), DraftPolicy(Drafter.NGRAM, 2)))
    copies = [t for t in study.trials if "duplicate_of" in t.user_attrs]
    assert copies
    assert len([t for t in study.trials if "whatif_of" in t.user_attrs]) == 1
    assert not any("whatif_of" in t.user_attrs for t in copies)


def test_everything_accepted_records_the_prediction_and_suggests_nothing(tmp_path):
    study, _, _ = tune(tmp_path, accepted=3, trials=3)
    model = study.trials[1]
    assert model.user_attrs["whatif_best_length"] == 3  # the measured length itself
    assert "whatif_predicted_best" not in model.user_attrs
    assert not any("whatif_of" in t.user_attrs for t in study.trials)


def test_a_missing_recording_is_logged_and_the_search_goes_on(tmp_path):
    study, _, events = tune(tmp_path, accepted=1, recording="no-such-file.jsonl", trials=4)
    assert st.search_trials_done(study) == 4
    assert "cannot read" in study.trials[1].user_attrs["whatif_error"]
    assert not any("whatif_of" in t.user_attrs for t in study.trials)
    assert any(e.kind is EventKind.WHATIF and e.message.startswith("no hint") for e in events)


def test_a_malformed_recording_is_logged_and_the_search_goes_on(tmp_path):
    (tmp_path / "garbage.jsonl").write_text("not json\n{}\n")
    study, _, _ = tune(tmp_path, accepted=1, recording="garbage.jsonl", trials=3)
    assert st.search_trials_done(study) == 3
    assert "not JSON" in study.trials[1].user_attrs["whatif_error"]


def test_bench_counts_a_switch_when_the_served_policies_change_not_their_ids():
    server = FakeServer()
    admin = SwitchCountingAdmin(server, "fake:0", retry_seconds=0.2, sleep=lambda s: None)
    plain, ngram = DraftPolicy(draft_length=0, policy_id="a"), DraftPolicy(Drafter.NGRAM, 3, policy_id="b")
    admin.apply(plain)
    admin.apply(dataclasses.replace(plain, policy_id="a2"))  # an id-only change swaps nothing
    assert admin.switches == 1
    admin.apply_split(TrafficSplit((TrafficArm(plain, 0.5), TrafficArm(ngram, 0.5))))
    admin.apply_split(TrafficSplit((TrafficArm(dataclasses.replace(plain, policy_id="c"), 0.5),
                                    TrafficArm(dataclasses.replace(ngram, policy_id="d"), 0.5))))
    assert admin.switches == 2
    admin.apply(plain)
    assert admin.switches == 3 and server.policy == plain
