"""`moespec tune --whatif-recording` against a real `moespec serve --record-steps` on loopback: the
tuner replays the file the server wrote for its measured trial, stores the prediction beside the
measurement and measures the predicted best shorter length next.

The study is created before the tuner starts with one enqueued trial, the model drafter at k=8 and
draft temperature 1.5, so the tuner's baselines are not added and the first measured trial is one
whose shorter lengths the replay judges clearly: a draft that hot is almost never accepted (~0.05
per position), so eight drafts and a nine-position verify buy nothing and a shorter length (as a
rule plain decoding, which this study has not measured yet) is predicted cheaper. (At temperature
0 the shipped pair agrees often enough that k=8 is sometimes predicted best: not a fixed premise.)"""

from __future__ import annotations

import threading

import optuna
import pytest
from optuna.trial import TrialState

from service.server.client import MoespecClient
from service.types import Drafter, DraftPolicy
from tests.tuner.test_tuner_e2e import TOKEN, free_port, run_tune, tune_cmd
from tuner.drivers.loadgen import DEFAULT_PROMPTS, LoadGenerator, LoadSpec, load_prompts
from tuner.drivers.server_proc import start_server, telemetry_env
from tuner.loop.space import SearchSpace, policy_key

optuna.logging.set_verbosity(optuna.logging.WARNING)
MEASURED = DraftPolicy(Drafter.MODEL, 8, 1.5)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A server recording its steps, exporting spans to a port the tuner will bind, under load."""
    path = tmp_path_factory.mktemp("rec") / "steps.jsonl"
    otlp_port = free_port()
    server = start_server(telemetry_env(f"http://127.0.0.1:{otlp_port}"), TOKEN,
                          ("--threads", "1", "--record-steps", str(path)))
    stop = threading.Event()
    try:
        with MoespecClient(server.address, admin_token=TOKEN) as client:
            client.wait_ready(timeout=60)
            gen = LoadGenerator(client, load_prompts(DEFAULT_PROMPTS), LoadSpec(concurrency=2, max_new_tokens=16))
            thread = threading.Thread(target=gen.run, args=(stop,), daemon=True)
            thread.start()
            yield server, client, otlp_port, path
            stop.set()
            thread.join(30)
    finally:
        stop.set()
        server.stop()


def test_tuner_enqueues_the_replay_s_best_shorter_length_and_stores_the_prediction(recorded, tmp_path):
    server, client, otlp_port, path = recorded
    storage = f"sqlite:///{tmp_path / 't.db'}"
    space = SearchSpace.from_model_info(client.model_info())
    study = optuna.create_study(storage=storage, study_name="w", direction="minimize")
    study.enqueue_trial(space.params_of(MEASURED), user_attrs={"role": "search"})
    result = run_tune(tune_cmd(server.address, otlp_port, storage, "--trials", "2", "--remeasure", "0",
                               "--prune-factor", "0", "--whatif-recording", str(path), study="w"))
    assert result.returncode == 0, result.stderr
    assert f"what-if hints from {path}" in result.stderr
    trials = optuna.load_study(study_name="w", storage=storage).trials
    first = trials[0]
    assert first.state is TrialState.COMPLETE, result.stderr
    attrs = first.user_attrs
    assert sorted(attrs["whatif_predicted"], key=int) == [str(k) for k in range(9)], result.stderr
    assert attrs["whatif_recorded_steps"] >= 8
    # k' = k replays the trial itself: its prediction is close to what the spans measured.
    assert 0.75 < attrs["whatif_predicted_at_measured_length"] / first.value < 1.33, attrs
    best = attrs["whatif_best_length"]
    assert best < MEASURED.draft_length, (attrs, result.stderr)
    assert attrs["whatif_predicted_best"] == attrs["whatif_predicted"][str(best)]
    # The next trial is the hint, measured for real on the server (its own policy id in the spans).
    hinted = trials[1]
    assert hinted.user_attrs["whatif_of"] == 0 and hinted.state is TrialState.COMPLETE, result.stderr
    policy = space.policy_from_params(hinted.params, "")
    expected = DraftPolicy(Drafter.MODEL, best, MEASURED.draft_temperature) if best else DraftPolicy(draft_length=0)
    assert policy_key(policy) == policy_key(expected)
    assert hinted.user_attrs["committed_tokens"] >= 48
    assert f"trial 0 what-if: {policy_key(expected).label()} predicted" in result.stderr
    assert "enqueued" in result.stderr
