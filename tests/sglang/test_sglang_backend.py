"""SGLangBackend on CPU against tests/sglang/fake_sglang.py: a stand-in for sglang.Engine and its
scheduler that replays a real SGLang 0.5.23 run's routing through moespec's real plugin code. The
backend's own code (swap gate, engine thread, stats channel, joining, calibration) runs for real."""

from __future__ import annotations

import argparse
import json
import threading
import types

import pytest

from service.sglang_backend import add_arguments, create_backend
from service.sglang_backend import cli as sglang_cli
from service.sglang_backend.backend import RECORDER_DIR_ENV
from service.sglang_plugin.wire import TAP_ENV
from service.types import Drafter, DraftPolicy, FinishReason, GenerationRequest, SamplingParams
from tests.sglang.fake_sglang import SCENARIO, FakeEngine


@pytest.fixture
def journal(monkeypatch):
    engines: list[FakeEngine] = []
    fake = types.SimpleNamespace(__version__="0.5.23", Engine=lambda **kw: FakeEngine(engines, **kw))
    monkeypatch.setattr(sglang_cli, "import_sglang", lambda: fake)
    monkeypatch.setattr(sglang_cli, "require_cuda", lambda: None)
    monkeypatch.setattr(sglang_cli, "check_plugin_hooks", lambda: None)  # the fake has the hook points
    # The backend sets these for SGLang's subprocesses; setenv here makes the test undo them.
    monkeypatch.setenv(RECORDER_DIR_ENV, "unset-by-test")
    monkeypatch.setenv(TAP_ENV, "")
    return engines


def model_dirs(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    for path, config in ((target, {"model_type": "qwen2_moe", "num_experts": 64, "num_experts_per_tok": 8,
                                   "moe_intermediate_size": 64, "shared_expert_intermediate_size": 256}),
                         (draft, {"model_type": "qwen2", "intermediate_size": 768})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 1024,
                                                      "max_position_embeddings": 512, **config}))
        (path / "model.safetensors").write_bytes(b"")
    return target, draft


def make_backend(tmp_path, *extra):
    target, draft = model_dirs(tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--drafter", default="model")
    parser.add_argument("--draft-length", type=int, default=0)
    args = parser.parse_args(["--model-path", str(target), "--draft-model-path", str(draft), *extra])
    return create_backend(args)


def request(name: str) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=tuple(SCENARIO.expected[name]["prompt_ids"]), max_new_tokens=64,
                             sampling=SamplingParams(temperature=0.0))


K3 = DraftPolicy(Drafter.MODEL, draft_length=3, policy_id="k3")


def test_a_policy_change_swaps_the_engine_and_publishes_the_measured_cost(tmp_path, journal):
    backend = make_backend(tmp_path)
    assert len(journal) == 1 and "speculative_algorithm" not in journal[0].kwargs
    assert backend.info.decode_step_seconds > 0  # calibrated by the plain warm-up
    result = backend.generate(request("A"), K3)
    assert len(journal) == 2 and journal[0].closed
    assert journal[1].kwargs["speculative_num_steps"] == 3 and journal[1].kwargs["speculative_num_draft_tokens"] == 4
    assert "expert_distribution_recorder_mode" not in journal[1].kwargs  # the plugin measures; no recorder
    assert backend.info.policy_switches == 1 and backend.info.policy_switch_seconds > 0
    backend.generate(request("A"), DraftPolicy(Drafter.MODEL, 3, 0.5, policy_id="same-engine"))
    assert len(journal) == 2  # policy_id / draft_temperature need no other engine
    assert result.finish_reason is FinishReason.LENGTH
    backend.close()


def test_steps_come_from_the_plugins_records(tmp_path, journal):
    backend = make_backend(tmp_path)
    result = backend.generate(request("B"), K3)
    want = SCENARIO.expected["B"]
    assert result.token_ids == tuple(want["output_ids"]) and result.completion_tokens == len(want["output_ids"])
    assert [s.accepted for s in result.steps] == [s["accepted"] for s in want["steps"]]
    assert [s.committed for s in result.steps] == [s["committed"] for s in want["steps"]]
    assert [s.unique_experts for s in result.steps] == [tuple(s["unique_experts"]) for s in want["steps"]]
    assert result.spec.verify_steps == 4 and result.spec.policy_id == "k3"
    assert result.spec.draft_temperature == 0.0  # SGLang drafts the argmax
    assert result.time_to_first_token > 0 and result.seconds >= result.time_to_first_token
    # Every step knows its pass: the fixture's passes served A and B together (B alone at the end).
    assert [s.batch.batch_size for s in result.steps] == [2, 2, 2, 1]
    assert all(s.batch.unique_experts_bound == min(64, s.batch.positions * 8) for s in result.steps)
    backend.close()


def test_concurrent_requests_each_get_their_own_windows(tmp_path, journal):
    backend = make_backend(tmp_path)
    backend.prepare(K3)
    results = {}

    def run(name):
        results[name] = backend.generate(request(name), K3)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("A", "B")]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    for name in ("A", "B"):
        want = SCENARIO.expected[name]["steps"]
        assert [(s.accepted, s.unique_experts) for s in results[name].steps] == [
            (w["accepted"], tuple(w["unique_experts"])) for w in want]
    # A pass both requests were in reports one batch record to each: the same pass id and batch union.
    shared = {s.batch.pass_id: s.batch for s in results["A"].steps}
    assert any(s.batch.pass_id in shared and s.batch == shared[s.batch.pass_id] for s in results["B"].steps)
    backend.close()


def test_stream_deltas_add_up_to_the_result(tmp_path, journal):
    backend = make_backend(tmp_path)
    deltas = []
    result = backend.generate(request("A"), K3, on_delta=deltas.append)
    assert tuple(t for d in deltas for t in d.token_ids) == result.token_ids
    assert "".join(d.text for d in deltas) == result.text
    backend.close()


def test_should_stop_aborts_the_sglang_request(tmp_path, journal):
    backend = make_backend(tmp_path)
    backend.prepare(K3)
    result = backend.generate(request("A"), K3, should_stop=lambda: True)
    assert journal[-1].aborted and result.finish_reason is FinishReason.CANCELLED
    assert len(result.steps) < 3  # it stopped before its last pass
    backend.close()


def test_a_speculative_start_calibrates_plain_first(tmp_path, journal):
    backend = make_backend(tmp_path, "--draft-length", "2")
    assert len(journal) == 2 and journal[1].kwargs["speculative_num_steps"] == 2
    assert backend.info.decode_step_seconds > 0 and backend.info.policy_switches == 1
    backend.close()


def test_without_the_recorder_counts_still_come_from_meta_info(tmp_path, journal):
    backend = make_backend(tmp_path, "--sglang-no-expert-record")
    assert journal[0].tap is None  # the plugin stays inert: no switch in the scheduler's environment
    result = backend.generate(request("A"), K3)
    assert result.spec.verify_steps == 3 and result.spec.unique_experts_max == (0, 0, 0, 0)
    backend.close()


def test_invalid_requests_name_the_field(tmp_path, journal):
    from service.types import InvalidRequest

    backend = make_backend(tmp_path)
    with pytest.raises(InvalidRequest) as e:
        backend.generate(GenerationRequest(prompt_token_ids=(5000,)), DraftPolicy())
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequest) as e:  # before any engine work: no swap for a policy it cannot run
        backend.generate(request("A"), DraftPolicy(Drafter.MODEL, 3, 0.0, tree_width=2))
    assert e.value.field == "policy.tree_width" and backend.info.policy_switches == 0
    backend.close()


def test_get_model_info_follows_every_swap_over_grpc(tmp_path, journal):
    # Finding 4 (sglang-cpu-notes): the servicer froze ModelInfo at start, so after switching back
    # to k = 0 GetModelInfo still showed the start-up policy_switches / policy_switch_seconds.
    from service.server.client import MoespecClient
    from service.server.server import ServerConfig
    from tests.conftest import ServerThread

    backend = make_backend(tmp_path)
    server = ServerThread(backend, ServerConfig(port=0, admin_token="t"))
    try:
        with MoespecClient(server.address, admin_token="t") as client:
            client.wait_ready(timeout=30)
            assert client.model_info().policy_switches == 0
            seen = []
            for policy in (K3, DraftPolicy(policy_id="plain-again")):
                client.set_policy(policy)
                client.generate(request("A"))
                info = client.model_info()
                assert (info.policy_switches, info.policy_switch_seconds) == (
                    backend.info.policy_switches, backend.info.policy_switch_seconds)
                seen.append(info.policy_switch_seconds)
            assert client.model_info().policy_switches == 2 and seen[0] != seen[1] and min(seen) > 0
    finally:
        server.stop()
        backend.close()


# -- `moespec serve --backend sglang --ep-size P --record-steps FILE` ------------------------------


def serve_backend(tmp_path, *extra):
    """Through `moespec serve`'s own parser and create_backend: --ep-size, --ep-placement and
    --record-steps are serve's flags, shared with the torch backend."""
    from service.cli import serve

    target, draft = model_dirs(tmp_path)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--backend", "sglang", "--model-path", str(target), "--draft-model-path", str(draft),
                              *map(str, extra)])
    return serve.create_backend(args)


def test_ep_fields_and_the_step_recording_agree_with_a_recount(tmp_path, journal, capsys):
    from service.cli import main
    from service.recording import read_recording
    from tests.sglang.test_sglang_ep import recount_physical

    path = tmp_path / "steps.jsonl"
    backend = serve_backend(tmp_path, "--ep-size", "4", "--record-steps", path)
    results = [backend.generate(request(name), K3) for name in ("A", "B")]
    backend.close()
    recording = read_recording(path)
    assert recording.header["hidden_size"] == 256 and recording.header["decode_step_seconds"] > 0
    # Only the two requests: the start-up calibration and each swap's warm-up are not traffic.
    assert [len(r) for r in recording.requests] == [len(r.steps) for r in results] == [3, 4]
    identity = [list(range(64))] * 4  # the fixture dump's map
    for result, recorded in zip(results, recording.requests, strict=True):
        for step, row in zip(result.steps, recorded, strict=True):
            assert (row.accepted, row.committed, row.window, row.window_ids, row.unique_experts) == (
                step.accepted, step.committed, step.window, step.window_ids, step.unique_experts)
            # From the ids the file holds, by plain sets: the fields the spans export.
            assert (list(step.ep_ranks_touched), list(step.ep_max_rank_experts), step.ep_dispatch_bytes) == \
                recount_physical(row.topk_ids, identity, 4)
    assert main(["whatif", str(path), "--ep-size", "4"]) == 0
    predictions = json.loads((tmp_path / "steps.jsonl.whatif.json").read_text())["predictions"]
    assert [p["draft_length"] for p in predictions] == [0, 1, 2, 3]
    assert "EP ranks / layer" in capsys.readouterr().out  # the table has the EP columns


@pytest.mark.parametrize(("extra", "reason"), [
    (("--ep-size", "3"), "--ep-size: 64 experts per layer do not split into 3 equal ranks"),
    (("--ep-size", "2", "--sglang-no-expert-record"), "--ep-size needs the routing statistics"),
    (("--record-steps", "steps.jsonl", "--sglang-no-expert-record"), "--record-steps needs the routing statistics"),
    (("--record-steps", "/nonexistent/folder/steps.jsonl"), "--record-steps: cannot write"),
], ids=["size-does-not-split", "ep-without-recorder", "record-without-recorder", "unwritable"])
def test_bad_ep_and_recording_flags_fail_before_any_engine_starts(tmp_path, journal, extra, reason):
    from service.errors import UsageError

    with pytest.raises(UsageError, match=reason):
        serve_backend(tmp_path, *extra)
    assert not journal
