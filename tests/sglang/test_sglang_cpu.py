"""The SGLang backend against a real SGLang 0.5.23 on this CPU, through `moespec serve` and gRPC.

One server (`moespec serve --backend sglang --device cpu`, fp32, the shipped target and draft) is
started for the module with tests/sglang_cpu/site on its PYTHONPATH: the stand-in sgl_kernel CPU ops
and post-import patches (see their docstrings). Everything else is real SGLang. The server keeps its
recorder dumps (--sglang-keep-records), each beside SGLang's own meta_info for that request, so the
tests compare three independent things: what moespec reports over gRPC / OTLP, what SGLang recorded
and said, and what an oracle (the embedded engine for outputs, transformers' router for experts)
recomputes. Tests run in file order and walk the policy switches plain -> model k=3 -> ngram k=4 ->
plain. The server runs with --ep-size 4 and --record-steps: verify spans' EP attributes are checked
against a recount from the recorded physical slots, and `moespec whatif` replays the step recording.

Runs only in the SGLang venv (`bash scripts/setup_sglang_cpu.sh`; `scripts/test.sh` runs this after
the main suite with that venv's python). Elsewhere every test skips with that reason, unless
MOESPEC_REQUIRE_SGLANG=1 (set by scripts/test.sh) turns the skip into a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from otel import attributes as a
from otel.receiver import OtlpTraceReceiver
from service.engine.weights import MODELS_DIR
from service.server.client import MoespecClient
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.sglang.test_sglang_ep import recount_physical
from tests.support.engine_helpers import heldout_prompts, make_engine
from tuner.drivers.loadgen import DEFAULT_PROMPTS, LoadGenerator, LoadSpec, load_prompts
from tuner.drivers.server_proc import MOESPEC, REPO_ROOT, start_server, telemetry_env

pytestmark = pytest.mark.sglang_cpu

SITE = Path(__file__).resolve().parents[1] / "sglang_cpu" / "site"
TOKEN = "sglang-cpu-test"
PROMPTS = heldout_prompts(2)
MAX_NEW = 40
TARGET_VERIFY = 5  # sglang ForwardMode.TARGET_VERIFY
K3 = DraftPolicy(Drafter.MODEL, draft_length=3, policy_id="model-k3")
NGRAM4 = DraftPolicy(Drafter.NGRAM, draft_length=4, policy_id="ngram-k4")
PLAIN = DraftPolicy(draft_length=0, policy_id="plain-again")
EP_SIZE = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy(prompt: str) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_new_tokens=MAX_NEW, sampling=SamplingParams(temperature=0.0))


@pytest.fixture(scope="module")
def otlp_port() -> int:
    # Fixed before the server starts (its OTLP endpoint); the tuner test later binds it itself.
    return free_port()


@pytest.fixture(scope="module")
def receiver(otlp_port):
    with OtlpTraceReceiver(port=otlp_port) as rx:
        yield rx


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-records")


@pytest.fixture(scope="module")
def steps_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-steps") / "steps.jsonl"


@pytest.fixture(scope="module")
def span_means() -> dict[str, dict[str, list]]:
    return {}  # policy id -> per-layer EP and union values of its verify spans, for the what-if check


@pytest.fixture(scope="module")
def server(receiver, otlp_port, record_dir, steps_file):
    if importlib.util.find_spec("sglang") is None:
        reason = ("sglang is not installed in this interpreter: build its venv with "
                  "`bash scripts/setup_sglang_cpu.sh` and run these tests with its python (scripts/test.sh does)")
        if os.environ.get("MOESPEC_REQUIRE_SGLANG") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    env = {**telemetry_env(f"http://127.0.0.1:{otlp_port}"),
           "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO_ROOT)])}
    args = ("--backend", "sglang", "--device", "cpu", "--model-path", str(MODELS_DIR / "target"),
            "--draft-model-path", str(MODELS_DIR / "draft"), "--sglang-arg", "dtype=float32",
            "--sglang-record-dir", str(record_dir), "--sglang-keep-records", "--verify-span-ratio", "1",
            "--ep-size", str(EP_SIZE), "--record-steps", str(steps_file), "--log-level", "INFO")
    proc = start_server(env, TOKEN, args, ready_timeout=900)
    yield proc
    proc.stop(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    with MoespecClient(server.address, admin_token=TOKEN) as c:
        c.wait_ready(timeout=60)
        yield c


@pytest.fixture(scope="module")
def embedded_greedy() -> dict[str, tuple[int, ...]]:
    engine = make_engine()
    return {p: engine.generate(greedy(p), DraftPolicy()).token_ids for p in PROMPTS}


@pytest.fixture(scope="module")
def oracle():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(MODELS_DIR / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plain_outputs() -> dict[str, tuple[int, ...]]:
    return {}  # filled by the first plain run, compared against by every later policy


# -- helpers over the kept evidence ----------------------------------------------------------------


def archived_requests(record_dir: Path) -> list[dict]:
    """Every request the backend archived, in order: request.json plus its recorded passes."""
    out = []
    for folder in sorted((record_dir / "read").iterdir()):
        meta = json.loads((folder / "request.json").read_text())
        if meta.get("warm_up"):
            continue
        passes, maps = [], []
        for dump in sorted(folder.glob("expert_distribution_recorder_*_0.pt")):
            data = torch.load(dump, map_location="cpu", weights_only=True)
            passes.extend(data["records"])
            maps.append(data["last_physical_to_logical_map"].tolist())
        out.append({**meta, "passes": passes, "folder": folder.name, "maps": maps})
    return out


def run_policy(client: MoespecClient, policy: DraftPolicy):
    stored = client.set_policy(policy)
    assert stored.draft_length == policy.draft_length
    return [client.generate(greedy(p), timeout=600) for p in PROMPTS]


def verify_spans(receiver: OtlpTraceReceiver, trace_id: str, count: int) -> list[dict]:
    got = receiver.wait_for(lambda spans: sum(s["trace_id"] == trace_id and s["name"] == a.VERIFY_SPAN_NAME
                                              for s in spans) >= count, timeout=30)
    mine = [s for s in got if s["trace_id"] == trace_id and s["name"] == a.VERIFY_SPAN_NAME]
    return sorted(mine, key=lambda s: s["start_ns"])


def window_paths(positions: list[int]) -> list[list[int]]:
    """Nodes each window node attends to among the window (itself last): for a node at position p,
    the latest earlier node at every position from the window's start up to p - 1. A chain gives
    [0..j]; NGRAM's sibling padding (several nodes at one position) hangs each pad off the chain."""
    paths = []
    for j, p in enumerate(positions):
        path = []
        for depth in range(positions[0], p):
            path.append(max(i for i in range(j) if positions[i] == depth))
        paths.append(path + [j])
    return paths


def oracle_topk(oracle, committed: list[int], record: dict, top_k: int) -> torch.Tensor:
    """Routed ids [L, w, m] the oracle picks for every node of a recorded verify window, each node
    seeing the committed prefix and its own path through the window."""
    start = record["positions"][0]
    ids = record["input_ids"]
    assert ids[0] == committed[start]  # the window starts at the last committed token
    per_node = []
    cache: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for path in window_paths(record["positions"]):
        sequence = tuple(committed[:start] + [ids[i] for i in path])
        if sequence not in cache:
            with torch.no_grad():
                cache[sequence] = oracle(torch.tensor(sequence)[None], output_router_logits=True).router_logits
        per_node.append(torch.stack([logits[-1].topk(top_k).indices for logits in cache[sequence]]))  # [L, m]
    return torch.stack(per_node, dim=1)  # [L, w, m]


def check_requests_against_oracle(record_dir, receiver, oracle, replies, policy, info, span_means):
    """For each reply of this policy: SGLang's meta_info, the recorded passes, the oracle and the
    verify spans all tell the same story; the spans' EP view is a recount of the recorded slots."""
    archived = [r for r in archived_requests(record_dir) if r["policy"]["policy_id"] == policy.policy_id]
    assert len(archived) == len(replies)
    E, m = info.num_experts, info.top_k
    for reply, request in zip(replies, archived, strict=True):
        meta = request["meta_info"]
        assert tuple(request["output_ids"]) == reply.token_ids
        committed = request["prompt_ids"] + request["output_ids"]
        verify = [r for r in request["passes"] if r["forward_mode"] == TARGET_VERIFY
                  and bool((r["topk_ids_of_layer"] >= 0).any())]
        # meta_info <-> the response <-> the recorder
        assert meta["spec_verify_ct"] == reply.spec.verify_steps == len(verify)
        assert meta["spec_num_correct_drafts"] == reply.spec.accepted_tokens
        assert meta["spec_num_proposed_drafts"] == len(verify) * policy.draft_length
        assert reply.spec.committed_tokens == len(reply.token_ids) - 1  # the prefill made the first token
        assert reply.spec.drafted_tokens <= meta["spec_num_proposed_drafts"]
        histogram = Counter()
        assert len(request["maps"]) == 1  # one dump per request: every pass ran with this map
        spans = verify_spans(receiver, reply.trace_id, len(verify))
        assert len(spans) == len(verify)
        for record, span in zip(verify, spans, strict=True):
            w = len(record["input_ids"])
            assert w == policy.draft_length + 1
            recorded = record["topk_ids_of_layer"][:, :, :m].long()  # [L, w, m] (identity EPLB map here)
            expected = oracle_topk(oracle, committed, record, m)
            assert torch.equal(recorded.sort(-1).values, expected.sort(-1).values), f"pass in {request['folder']}"
            unique = [int(recorded[layer].unique().numel()) for layer in range(recorded.shape[0])]
            assert list(span["attributes"][a.MOE_UNIQUE_EXPERTS]) == unique
            assert all(m <= u <= min(E, w * m) for u in unique)
            assert span["attributes"][a.MOE_UNIQUE_EXPERTS_BOUND] == min(E, w * m)
            histogram[span["attributes"][a.SPEC_ACCEPTED_TOKENS]] += 1
            ep = (list(span["attributes"][a.MOE_EP_RANKS_TOUCHED]), list(span["attributes"][a.MOE_EP_MAX_RANK_EXPERTS]),
                  span["attributes"][a.MOE_EP_DISPATCH_BYTES])
            assert ep == recount_physical(record["topk_ids_of_layer"].tolist(), request["maps"][0], EP_SIZE)
            means = span_means.setdefault(policy.policy_id, {"ranks": [], "most": [], "unique": []})
            means["ranks"].append(ep[0])
            means["most"].append(ep[1])
            means["unique"].append(unique)
        assert [histogram[i] for i in range(len(meta["spec_correct_drafts_histogram"]))] == \
            meta["spec_correct_drafts_histogram"]


# -- the tests, in the order they run --------------------------------------------------------------


def test_model_info_says_sglang_on_cpu(client):
    info = client.model_info()
    assert (info.backend, info.device) == ("sglang", "cpu")
    assert info.drafters == (Drafter.MODEL, Drafter.NGRAM)
    assert (info.policy_switches, info.policy_switch_seconds) == (0, 0.0)
    assert info.decode_step_seconds > 0  # calibrated by the start-up warm-up


def test_plain_greedy_equals_the_embedded_engine(client, embedded_greedy, plain_outputs, receiver):
    client.set_policy(DraftPolicy(draft_length=0, policy_id="plain"))
    for prompt in PROMPTS:
        reply = client.generate(greedy(prompt), timeout=600)
        assert reply.token_ids == embedded_greedy[prompt]
        assert reply.spec.verify_steps == len(reply.token_ids) - 1  # one decode step per token after the first
        plain_outputs[prompt] = reply.token_ids
        spans = verify_spans(receiver, reply.trace_id, reply.spec.verify_steps)
        assert all(s["attributes"][a.MOE_UNIQUE_EXPERTS_BOUND] == client.model_info().top_k for s in spans)


@pytest.mark.parametrize(("policy", "switches"), [(K3, 1), (NGRAM4, 2)], ids=["model-k3", "ngram-k4"])
def test_speculation_is_lossless_and_its_experts_match_the_oracle(client, plain_outputs, record_dir, receiver,
                                                                   oracle, span_means, policy, switches):
    before = client.model_info()
    replies = run_policy(client, policy)
    assert [r.token_ids for r in replies] == [plain_outputs[p] for p in PROMPTS]
    info = client.model_info()
    assert info.policy_switches == switches == before.policy_switches + 1
    assert info.policy_switch_seconds > 0 and info.policy_switch_seconds != before.policy_switch_seconds
    for reply in replies:
        assert (reply.spec.policy_id, reply.spec.drafter, reply.spec.draft_length) == (
            policy.policy_id, policy.drafter, policy.draft_length)
    check_requests_against_oracle(record_dir, receiver, oracle, replies, policy, info, span_means)


def test_back_to_plain_is_a_switch_too(client, plain_outputs):
    before = client.model_info()
    replies = run_policy(client, PLAIN)
    assert [r.token_ids for r in replies] == [plain_outputs[p] for p in PROMPTS]
    info = client.model_info()
    assert info.policy_switches == before.policy_switches + 1 == 3
    assert info.policy_switch_seconds != before.policy_switch_seconds
    assert all(r.spec.draft_length == 0 and r.spec.verify_steps == len(r.token_ids) - 1 for r in replies)


@pytest.mark.parametrize("policy", [K3, NGRAM4], ids=["model-k3", "ngram-k4"])
def test_whatif_replays_the_step_recording(steps_file, span_means, tmp_path, policy):
    from service.recording import read_recording

    recording = read_recording(steps_file)
    # Every request so far (plain, k=3, ngram k=4, plain again), none rebuilt from counts alone.
    assert Counter(s.policy_id for r in recording.requests for s in r[:1]) == {
        "plain": len(PROMPTS), K3.policy_id: len(PROMPTS), NGRAM4.policy_id: len(PROMPTS),
        PLAIN.policy_id: len(PROMPTS)}
    done = subprocess.run([*MOESPEC, "whatif", str(steps_file), "--policy", policy.policy_id, "--ep-size",
                           str(EP_SIZE), "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "whatif.json").read_text())
    predictions = result["predictions"]
    assert [p["draft_length"] for p in predictions] == list(range(policy.draft_length + 1))
    assert result["steps"] == len(span_means[policy.policy_id]["ranks"])
    # At k' = k the replay's windows are the recorded ones, so its means are the verify spans' means;
    # except NGRAM's filler positions, which whatif leaves out of a window (it keeps the drafted ones
    # only) although SGLang verifies them: there it can only count less (docs/limits.md).
    full = predictions[-1]
    for key, field in (("ranks", "ep_ranks_touched_mean"), ("most", "ep_max_rank_experts_mean"),
                       ("unique", "unique_experts_mean")):
        per_layer = span_means[policy.policy_id][key]
        expected = [sum(column) / len(column) for column in zip(*per_layer, strict=True)]
        if policy.drafter is Drafter.MODEL:
            assert full[field] == pytest.approx(expected), key
        else:
            assert all(got <= want + 1e-9 for got, want in zip(full[field], expected, strict=True)), key
    assert all(1 <= r <= EP_SIZE for p in predictions for r in p["ep_ranks_touched_mean"])


def test_spans_carry_the_embedded_backends_attribute_keys(client, receiver, otlp_port):
    reply = client.generate(greedy(PROMPTS[0]), timeout=600)
    sglang_spans = [s for s in receiver.wait_for(
        lambda got: any(s["trace_id"] == reply.trace_id and s["name"] != a.VERIFY_SPAN_NAME
                        and s["kind"] == "INTERNAL" for s in got), timeout=30) if s["trace_id"] == reply.trace_id]
    request_span = next(s for s in sglang_spans if s["kind"] == "INTERNAL" and s["name"] != a.VERIFY_SPAN_NAME)
    verify_span = next(s for s in sglang_spans if s["name"] == a.VERIFY_SPAN_NAME)
    assert request_span["resource"][a.RESOURCE_BACKEND] == "sglang"
    assert request_span["resource"][a.RESOURCE_DEVICE] == "cpu"
    embedded = start_server(telemetry_env(f"http://127.0.0.1:{otlp_port}", service_name="embedded"), TOKEN,
                            ("--threads", "1", "--verify-span-ratio", "1", "--ep-size", str(EP_SIZE)))
    try:
        with MoespecClient(embedded.address, admin_token=TOKEN) as c:
            c.wait_ready(timeout=60)
            other = c.generate(greedy(PROMPTS[0]), timeout=120)
    finally:
        embedded.stop()
    theirs = [s for s in receiver.wait_for(
        lambda got: any(s["trace_id"] == other.trace_id and s["kind"] == "INTERNAL"
                        and s["name"] != a.VERIFY_SPAN_NAME for s in got), timeout=30)
        if s["trace_id"] == other.trace_id]
    their_request = next(s for s in theirs if s["kind"] == "INTERNAL" and s["name"] != a.VERIFY_SPAN_NAME)
    their_verify = next(s for s in theirs if s["name"] == a.VERIFY_SPAN_NAME)
    # The embedded engine batches requests itself and reports each request's mean batch union; the
    # SGLang backend attributes per-request windows only (docs/limits.md), so that key is its one extra.
    batching_only = {a.MOE_BATCH_UNIQUE_EXPERTS_MEAN}
    assert set(request_span["attributes"]) == set(their_request["attributes"]) - batching_only
    assert set(request_span["attributes"]) >= set(a.REQUEST_SPAN_KEYS) - batching_only
    assert set(verify_span["attributes"]) == set(their_verify["attributes"]) >= set(a.VERIFY_SPAN_KEYS)
    ep_keys = {a.MOE_EP_RANKS_TOUCHED, a.MOE_EP_MAX_RANK_EXPERTS, a.MOE_EP_DISPATCH_BYTES}
    assert ep_keys <= set(verify_span["attributes"])  # both servers run with --ep-size
    assert {a.MOE_EP_RANKS_TOUCHED_MEAN, a.MOE_EP_MAX_RANK_EXPERTS_MAX, a.MOE_EP_DISPATCH_BYTES} <= set(
        request_span["attributes"])


def test_a_short_tuner_run_completes(client, server, receiver, otlp_port, tmp_path):
    receiver.stop()  # the tuner's own receiver takes the port the server exports to
    stop = threading.Event()
    load = LoadGenerator(client, load_prompts(DEFAULT_PROMPTS), LoadSpec(concurrency=1, max_new_tokens=16))
    thread = threading.Thread(target=load.run, args=(stop,), daemon=True)
    thread.start()
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    cmd = [*MOESPEC, "tune", "--server", server.address, "--otlp-listen", f"127.0.0.1:{otlp_port}",
           "--storage", storage, "--study", "sglang-cpu", "--admin-token", TOKEN, "--seed", "0", "--trials", "3",
           "--remeasure", "0", "--min-tokens", "48", "--min-steps", "8", "--max-window-seconds", "240",
           # Windows of at least one switch time (the default 10x is for real deployments; CI's time is short).
           "--switch-window-factor", "1"]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "MOESPEC_ADMIN_TOKEN": ""})
    finally:
        stop.set()
        thread.join(60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import optuna
    from optuna.trial import TrialState

    study = optuna.load_study(study_name="sglang-cpu", storage=storage)
    states = [t.state for t in study.trials]
    # Every trial ran to an end: measured, pruned by the tuner's rule, or starved (reason recorded).
    assert len(states) == 3, (time.monotonic() - t0, states, done.stdout[-2000:])
    for t in study.trials:
        assert t.state in (TrialState.COMPLETE, TrialState.PRUNED) or t.user_attrs["fail_reason"].startswith("starved")
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert complete and all(t.value > 0 for t in complete)
    assert "best policy:" in done.stdout
    # The switch cost is accounted for: SGLang runs one policy at a time, so the tuner measured
    # candidates between control windows of the incumbent (not beside it), and every switch was timed.
    assert study.user_attrs["trial_mode"] == "interleaved"
    assert all(t.user_attrs.get("trial_mode") == "interleaved" for t in study.trials[1:] if t.state != TrialState.FAIL)
    assert client.model_info().policy_switches >= 2 and client.model_info().policy_switch_seconds > 0
