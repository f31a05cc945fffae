"""The SGLang backend against a real SGLang 0.5.23 on this CPU, through `moespec serve` and gRPC.

First a bare `sglang.Engine` with the backend's own engine arguments runs the held-out prompts (one
after another, then as one batch: service/bench/sglang_alone.py); then one server (`moespec serve
--backend sglang --device cpu`, fp32, the shipped target and draft) is started for the module with
tests/sglang_cpu/site on its PYTHONPATH: the stand-in sgl_kernel CPU ops and post-import patches (see
their docstrings). Everything else is real SGLang, with moespec's plugin in its scheduler.

The server also runs SGLang's own per_token recorder as a cross-check (--sglang-record-dir: dumped at
every engine stop), so the tests compare four independent things: what moespec reports over gRPC /
OTLP (the plugin's statistics), what SGLang's recorder recorded, what SGLang alone returns, and what
an oracle (the embedded engine for outputs, transformers' router for experts) recomputes. Tests run
in file order and walk plain -> model k=3 (swapped under load) -> ngram k=4 -> ngram k=8 -> plain. The server runs
with --ep-size 4 and --record-steps: verify spans' EP attributes are checked against a recount from
the recorded physical slots, and `moespec whatif` replays the step recording.

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
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from otel import attributes as a
from otel.receiver import OtlpTraceReceiver
from service.engine.model.weights import MODELS_DIR
from service.routing.expert_sets import pairwise_overlap
from service.server.client import MoespecClient
from service.sglang_backend.attribution import RequestTokens, attribute, unique_experts
from service.sglang_backend.records import dump_files, load_dump
from service.types import Drafter, DraftPolicy, FinishReason, GenerationRequest, SamplingParams
from tests.sglang.test_sglang_ep import recount_physical
from tests.support.engine_helpers import heldout_prompts, make_engine
from tuner.drivers.loadgen import DEFAULT_PROMPTS, LoadGenerator, LoadSpec, load_prompts
from tuner.drivers.server_proc import MOESPEC, REPO_ROOT, start_server, telemetry_env

pytestmark = pytest.mark.sglang_cpu

SITE = Path(__file__).resolve().parents[1] / "sglang_cpu" / "site"
TOKEN = "sglang-cpu-test"
PROMPTS = heldout_prompts(8)  # 8 concurrent clients
MAX_NEW = 32
TARGET_VERIFY = 5  # sglang ForwardMode.TARGET_VERIFY
K3 = DraftPolicy(Drafter.MODEL, draft_length=3, policy_id="model-k3")
NGRAM4 = DraftPolicy(Drafter.NGRAM, draft_length=4, policy_id="ngram-k4")
NGRAM8 = DraftPolicy(Drafter.NGRAM, draft_length=8, policy_id="ngram-k8")
PLAIN = DraftPolicy(draft_length=0, policy_id="plain-again")
EP_SIZE = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy(prompt: str, max_new: int = MAX_NEW) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_new_tokens=max_new, sampling=SamplingParams(temperature=0.0))


def sampled(prompt: str, seed: int) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_new_tokens=MAX_NEW, sampling=SamplingParams(temperature=0.8, seed=seed))


def concurrently(calls) -> list:
    """Run the calls at once, one client thread each (8 clients), results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def tokenize(prompts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODELS_DIR / "target" / "tokenizer.json"))
    return [tokenizer.encode(p).ids for p in prompts]


def sglang_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(SITE), str(REPO_ROOT)])}


def serve(env: dict[str, str], token: str, args: tuple[str, ...]):
    """A module's `moespec serve` (its server fixture yields from this), stopped after the module."""
    proc = start_server(env, token, args, ready_timeout=900)
    yield proc
    proc.stop(timeout=60)


def connect(server, token: str):
    """A ready admin client of that server (a module's client fixture yields from this)."""
    with MoespecClient(server.address, admin_token=token) as c:
        c.wait_ready(timeout=60)
        yield c


def plain_greedy_outputs(prompts: list[str], max_new: int = MAX_NEW) -> dict[str, tuple[int, ...]]:
    """Each prompt's greedy output from the embedded engine: what SGLang's must equal, token for token."""
    engine = make_engine()
    return {p: engine.generate(greedy(p, max_new), DraftPolicy()).token_ids for p in prompts}


def require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        reason = ("sglang is not installed in this interpreter: build its venv with "
                  "`bash scripts/setup_sglang_cpu.sh` and run these tests with its python (scripts/test.sh does)")
        if os.environ.get("MOESPEC_REQUIRE_SGLANG") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


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


SERVE_SGLANG = ("--device", "cpu", "--model-path", str(MODELS_DIR / "target"), "--sglang-arg", "dtype=float32")


@pytest.fixture(scope="module")
def sglang_alone(tmp_path_factory) -> dict:
    """SGLang alone on the held-out prompts, before the server starts (one engine at a time on 2 cores)."""
    require_sglang()
    prompts = tmp_path_factory.mktemp("alone") / "prompts.json"
    prompts.write_text(json.dumps(tokenize(PROMPTS)))
    done = subprocess.run([sys.executable, "-m", "service.bench.sglang_alone", "--prompts", str(prompts),
                           "--max-new-tokens", str(MAX_NEW), *SERVE_SGLANG], cwd=REPO_ROOT,
                          env={**os.environ, **sglang_env()}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def server(sglang_alone, receiver, otlp_port, record_dir, steps_file):
    require_sglang()
    env = {**telemetry_env(f"http://127.0.0.1:{otlp_port}"), **sglang_env()}
    args = ("--backend", "sglang", *SERVE_SGLANG, "--draft-model-path", str(MODELS_DIR / "draft"),
            "--sglang-record-dir", str(record_dir), "--verify-span-ratio", "1",
            "--ep-size", str(EP_SIZE), "--record-steps", str(steps_file), "--log-level", "INFO")
    yield from serve(env, TOKEN, args)


@pytest.fixture(scope="module")
def client(server):
    yield from connect(server, TOKEN)


@pytest.fixture(scope="module")
def embedded_greedy() -> dict[str, tuple[int, ...]]:
    return plain_greedy_outputs(PROMPTS)


@pytest.fixture(scope="module")
def oracle():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(MODELS_DIR / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plain_outputs() -> dict[str, tuple[int, ...]]:
    return {}  # filled by the first plain run, compared against by every later policy


@pytest.fixture(scope="module")
def replies() -> dict[str, list]:
    return {}  # policy id -> every reply of that policy, checked against the recorder once it has dumped


# -- helpers over the evidence ---------------------------------------------------------------------


def recorder_windows(record_dir: Path, tokens: list[RequestTokens], width: int, moe: tuple[int, ...]) -> list:
    """Each request's verify windows as SGLang's own recorder saw them, split by tokens and positions
    (attribution.attribute). One dump per stopped engine, attributed apart: another engine served the
    same prompts with the same greedy tokens, and its passes must not be read as this one's."""
    best: list[list] = [[] for _ in tokens]
    for path in dump_files(record_dir):
        found = attribute(load_dump(path), tokens, speculative=True, verify_width=width, moe_layers=moe)
        best = [f if len(f) > len(b) else b for f, b in zip(found, best, strict=True)]
    return best


def verify_spans(receiver: OtlpTraceReceiver, trace_id: str, count: int) -> list[dict]:
    got = receiver.wait_for(lambda spans: sum(s["trace_id"] == trace_id and s["name"] == a.VERIFY_SPAN_NAME
                                              for s in spans) >= count, timeout=30)
    mine = [s for s in got if s["trace_id"] == trace_id and s["name"] == a.VERIFY_SPAN_NAME]
    return sorted(mine, key=lambda s: s["start_ns"])


def oracle_paths(oracle, committed: list[int], ids: tuple[int, ...], positions: tuple[int, ...],
                 recorded: torch.Tensor, top_k: int) -> list[list[tuple[int, ...]]]:
    """The window's tree as the oracle explains SGLang's routing: for each node, every path from the root
    (node indices, root first) through nodes one position apart such that the oracle, fed the committed
    prefix and that path, routes the node to the experts SGLang's recorder saw ([L, w, m] `recorded`).
    Usually one path per node; two siblings whose continuations route alike leave their children with
    two. A node no path explains fails the test: the recorded routing is then not the target's on any
    tree of these nodes."""
    start = positions[0]
    assert ids[0] == committed[start]  # the window starts at the last committed token
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def routes(path: tuple[int, ...]) -> bool:
        sequence = tuple(committed[:start] + [ids[i] for i in path])
        if sequence not in cache:
            with torch.no_grad():
                logits = oracle(torch.tensor(sequence)[None], output_router_logits=True).router_logits
            cache[sequence] = torch.stack([x[-1].topk(top_k).indices for x in logits]).sort(-1).values  # [L, m]
        return torch.equal(cache[sequence], recorded[:, path[-1]].sort(-1).values)

    assert routes((0,))
    paths: list[list[tuple[int, ...]]] = [[(0,)]]
    for j in range(1, len(ids)):
        candidates = [i for i in range(j) if positions[i] == positions[j] - 1]
        paths.append([p + (j,) for i in candidates for p in paths[i] if routes(p + (j,))])
        assert paths[j], f"window at {start}: no parent among {candidates} explains node {j}'s routing"
    return paths


def oracle_accepted(ids: tuple[int, ...], paths: list[list[tuple[int, ...]]], start: int, committed: list[int]) -> int:
    """The most drafts any oracle-explained path accepts: its node at depth d carries the token
    committed at start + d (draft_tree.accepted_path on the one tree, when the routing names one)."""
    return max(len(p) - 1 for node_paths in paths for p in node_paths
               if all(start + d < len(committed) and ids[n] == committed[start + d] for d, n in enumerate(p)))


def check_against_the_recorder(record_dir, receiver, oracle, entries, policy, info, span_means) -> Counter:
    """Each reply of this policy: the plugin's verify spans, SGLang's recorder (recounted here by plain
    sets; acceptance from where each window starts) and, for greedy replies, the oracle all tell the
    same story, in 100% of verify steps; the spans' EP view is a recount of the recorded slots. Returns
    windows by NGRAM padding (0 = a full match)."""
    E, m, moe = info.num_experts, info.top_k, tuple(range(info.num_layers))
    tokens = [RequestTokens(tuple(prompt_ids), reply.token_ids) for prompt_ids, reply, _ in entries]
    windows = recorder_windows(record_dir, tokens, policy.draft_length + 1, moe)
    paddings = Counter()
    for (prompt_ids, reply, is_greedy), found in zip(entries, windows, strict=True):
        committed = list(prompt_ids) + list(reply.token_ids)
        assert reply.spec.verify_steps == len(found) > 0  # the plugin saw every verify pass the recorder saw
        assert reply.spec.accepted_tokens == sum(w.accepted for w in found)
        assert reply.spec.committed_tokens == len(reply.token_ids) - 1  # the prefill made the first token
        assert all(u >= m for u in reply.spec.unique_experts_max)
        spans = verify_spans(receiver, reply.trace_id, len(found))
        assert len(spans) == len(found)
        for w, span in zip(found, spans, strict=True):
            assert w.width == policy.draft_length + 1
            recount = unique_experts(w.topk_ids, moe, E)  # the recorder's ids, by torch.unique
            assert list(span["attributes"][a.MOE_UNIQUE_EXPERTS]) == list(recount)  # the plugin's, on device
            overlap_mean, overlap_min = pairwise_overlap(w.topk_ids[list(moe), :, :m].numpy(), E)  # numpy, on host
            assert list(span["attributes"][a.MOE_PAIRWISE_OVERLAP_MIN]) == list(overlap_min)
            assert list(span["attributes"][a.MOE_PAIRWISE_OVERLAP_MEAN]) == pytest.approx(overlap_mean)
            assert all(m <= u <= min(E, w.width * m) for u in recount)
            assert span["attributes"][a.SPEC_ACCEPTED_TOKENS] == w.accepted
            if is_greedy:  # the tree that explains the routing also explains the acceptance
                paths = oracle_paths(oracle, committed, w.input_ids, w.positions, w.topk_ids[:, :, :m].long(), m)
                assert oracle_accepted(w.input_ids, paths, w.start, committed) == w.accepted
            ep = (list(span["attributes"][a.MOE_EP_RANKS_TOUCHED]), list(span["attributes"][a.MOE_EP_MAX_RANK_EXPERTS]),
                  span["attributes"][a.MOE_EP_DISPATCH_BYTES])
            assert ep == recount_physical(w.physical_ids.tolist(), w.physical_to_logical.tolist(), EP_SIZE)
            means = span_means.setdefault(policy.policy_id, {"ranks": [], "most": [], "unique": []})
            means["ranks"].append(ep[0])
            means["most"].append(ep[1])
            means["unique"].append(list(recount))
            paddings[w.padding] += 1
    return paddings


def run_concurrently(client: MoespecClient, policy: DraftPolicy, replies, plain_outputs) -> list:
    """8 greedy clients and 2 sampled ones at once under `policy`; greedy must equal plain decoding."""
    prompt_ids = tokenize(PROMPTS)
    requests = [(ids, greedy(p), True) for ids, p in zip(prompt_ids, PROMPTS, strict=True)]
    requests += [(prompt_ids[i], sampled(PROMPTS[i], seed=i), False) for i in (0, 1)]
    got = concurrently([lambda r=r: client.generate(r[1], timeout=600) for r in requests])
    entries = [(ids, reply, is_greedy) for (ids, _, is_greedy), reply in zip(requests, got, strict=True)]
    replies.setdefault(policy.policy_id, []).extend(entries)
    assert [r.token_ids for _, r, g in entries if g] == [plain_outputs[p] for p in PROMPTS]  # lossless
    for _, reply, _ in entries:
        assert (reply.spec.policy_id, reply.spec.drafter, reply.spec.draft_length) == (
            policy.policy_id, policy.drafter, policy.draft_length)
    return entries


# -- the tests, in the order they run --------------------------------------------------------------


def test_the_plugin_is_inert_unless_the_backend_switched_it_on(tmp_path):
    """SGLang's own plugin loader in a fresh process, as every scheduler runs it: without moespec's switch
    the entry point loads and hooks nothing; with it, the model runner's forward is wrapped."""
    require_sglang()
    script = ("import json, sglang.srt.plugins as p\n"
              "from sglang.srt.plugins.hook_registry import HookRegistry\n"
              "from sglang.srt.model_executor.model_runner import ModelRunner\n"
              "before = [ModelRunner.forward]\n"  # in a list: the registry rebinds module-level names it patched
              "p.load_plugins()\n"
              "wrapped = ModelRunner.forward is not before[0]\n"
              "print(json.dumps({'hooks': sorted(HookRegistry._hooks), 'wrapped': wrapped}))")
    from service.sglang_plugin.wire import TAP_ENV, TapConfig

    seen = {}
    for switched in (False, True):
        env = {k: v for k, v in os.environ.items() if k != TAP_ENV}
        env.update(sglang_env(), SGLANG_USE_CPU_ENGINE="1")
        if switched:
            env[TAP_ENV] = TapConfig(f"ipc://{tmp_path / 'tap.sock'}").to_env()
        done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        seen[switched] = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen[False] == {"hooks": [], "wrapped": False}
    assert seen[True]["wrapped"] and len(seen[True]["hooks"]) == 2


def test_the_hook_points_are_checked_and_another_version_fails_in_one_line(monkeypatch):
    require_sglang()
    from service.sglang_plugin import hook_points

    hook_points.check_hook_points()  # this SGLang has them
    monkeypatch.setattr(hook_points, "MODEL_FORWARD", "sglang.srt.model_executor.model_runner.ModelRunner.run")
    with pytest.raises(hook_points.HookPointError) as e:
        hook_points.check_hook_points()
    assert "ModelRunner" in str(e.value) and "0.5.23" in str(e.value) and "\n" not in str(e.value)


def test_model_info_says_sglang_on_cpu(client):
    info = client.model_info()
    assert (info.backend, info.device) == ("sglang", "cpu")
    assert info.drafters == (Drafter.MODEL, Drafter.NGRAM)
    assert (info.policy_switches, info.policy_switch_seconds) == (0, 0.0)
    assert info.decode_step_seconds > 0  # calibrated by the start-up warm-up


def test_plain_greedy_equals_the_embedded_engine(client, embedded_greedy, receiver):
    client.set_policy(DraftPolicy(draft_length=0, policy_id="plain"))
    for prompt in PROMPTS[:2]:
        reply = client.generate(greedy(prompt), timeout=600)
        assert reply.token_ids == embedded_greedy[prompt]
        assert reply.spec.verify_steps == len(reply.token_ids) - 1  # one decode step per token after the first
        spans = verify_spans(receiver, reply.trace_id, reply.spec.verify_steps)
        assert all(s["attributes"][a.MOE_UNIQUE_EXPERTS_BOUND] == client.model_info().top_k for s in spans)
        assert all(list(s["attributes"][a.MOE_UNIQUE_EXPERTS]) == [8] * 4 for s in spans)  # one token: top-k each


def test_8_concurrent_clients_get_what_sglang_alone_returns(client, sglang_alone, plain_outputs, receiver):
    alone = sglang_alone["rounds"][0]
    t0 = time.perf_counter()
    one_by_one = [client.generate(greedy(p), timeout=600) for p in PROMPTS]
    sequential_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    together = concurrently([lambda p=p: client.generate(greedy(p), timeout=600) for p in PROMPTS])
    concurrent_s = time.perf_counter() - t0
    assert [list(r.token_ids) for r in together] == alone["batch"]
    for prompt, reply in zip(PROMPTS, together, strict=True):
        plain_outputs[prompt] = reply.token_ids
    # Served in shared passes: the steps' batch records say how many requests each pass carried.
    receiver.wait_for(lambda got: any(s["name"] == a.VERIFY_BATCH_SPAN_NAME and s["attributes"][a.BATCH_SIZE] > 1
                                      for s in got), timeout=30)  # raises when no pass carried two
    print(f"\nplain greedy, {len(PROMPTS)} prompts x {MAX_NEW} tokens: through moespec "
          f"{sequential_s / concurrent_s:.2f}x from 8 clients at once over one at a time; SGLang alone "
          f"{alone['sequential_s'] / alone['batch_s']:.2f}x (one batch call over one at a time); "
          f"one-at-a-time outputs equal: {[list(r.token_ids) for r in one_by_one] == alone['sequential']}")


def test_cancellation_and_deadlines_under_load_touch_no_other_request(client, plain_outputs):
    long = MAX_NEW * 4

    def cancelled_stream():
        chunks = client.stream(greedy(PROMPTS[0], long), timeout=600)
        next(chunks)
        chunks.close()  # the client goes away after its first chunk
        return "cancelled"

    def past_deadline():
        try:
            client.generate(greedy(PROMPTS[1], long), timeout=0.5)
        except grpc.RpcError as e:
            return e.code()
        return "finished"

    calls = [cancelled_stream, past_deadline] + [lambda p=p: client.generate(greedy(p), timeout=600)
                                                 for p in PROMPTS[2:]]
    got = concurrently(calls)
    assert got[:2] == ["cancelled", grpc.StatusCode.DEADLINE_EXCEEDED]
    assert [r.token_ids for r in got[2:]] == [plain_outputs[p] for p in PROMPTS[2:]]
    assert all(r.finish_reason is FinishReason.LENGTH or len(r.token_ids) < MAX_NEW for r in got[2:])
    # The server is still whole: a request after them runs as before.
    assert client.generate(greedy(PROMPTS[0]), timeout=600).token_ids == plain_outputs[PROMPTS[0]]


def test_a_swap_under_load_loses_nothing_and_speculation_is_lossless(client, plain_outputs, replies):
    """4 clients keep sending while the policy changes to model k=3: the swap drains them, then they run on
    the new engine; no request fails, and every one that started after SetPolicy reports k=3."""
    stop, load_replies, errors = threading.Event(), [], []

    def load(prompt):
        while not stop.is_set():
            try:
                sent = time.monotonic()
                load_replies.append((sent, prompt, client.generate(greedy(prompt, 8), timeout=600)))
            except Exception as e:  # any error is a lost request
                errors.append(e)

    threads = [threading.Thread(target=load, args=(p,)) for p in PROMPTS[:4]]
    [t.start() for t in threads]
    time.sleep(2)
    before = client.model_info()
    client.set_policy(K3)
    set_at = time.monotonic()  # a request sent before SetPolicy returned may have reached the server first
    entries = run_concurrently(client, K3, replies, plain_outputs)
    time.sleep(1)
    stop.set()
    [t.join(600) for t in threads]
    assert not errors
    assert any(sent < set_at for sent, _, _ in load_replies) and any(sent > set_at for sent, _, _ in load_replies)
    assert all(r.spec.policy_id == K3.policy_id for sent, _, r in load_replies if sent > set_at)
    # Those that ran on the new engine are k=3 requests like the others: the recorder check covers them too.
    ids = dict(zip(PROMPTS, tokenize(PROMPTS), strict=True))
    replies[K3.policy_id] += [(ids[p], r, True) for _, p, r in load_replies if r.spec.policy_id == K3.policy_id]
    info = client.model_info()
    assert info.policy_switches == before.policy_switches + 1 == 1
    assert info.policy_switch_seconds > 0
    assert len(entries) == 10


@pytest.mark.parametrize(("policy", "switches"), [(NGRAM4, 2), (NGRAM8, 3)], ids=["ngram-k4", "ngram-k8"])
def test_ngram_is_lossless_under_8_clients(client, plain_outputs, replies, policy, switches):
    before = client.model_info()
    client.set_policy(policy)
    run_concurrently(client, policy, replies, plain_outputs)
    info = client.model_info()
    assert info.policy_switches == before.policy_switches + 1 == switches
    assert info.policy_switch_seconds != before.policy_switch_seconds


def test_back_to_plain_is_a_switch_too(client, plain_outputs):
    before = client.model_info()
    client.set_policy(PLAIN)
    got = concurrently([lambda p=p: client.generate(greedy(p), timeout=600) for p in PROMPTS])
    assert [r.token_ids for r in got] == [plain_outputs[p] for p in PROMPTS]
    info = client.model_info()
    assert info.policy_switches == before.policy_switches + 1 == 4
    assert info.policy_switch_seconds != before.policy_switch_seconds
    assert all(r.spec.draft_length == 0 and r.spec.verify_steps == len(r.token_ids) - 1 for r in got)


@pytest.mark.parametrize("policy", [K3, NGRAM4, NGRAM8], ids=["model-k3", "ngram-k4", "ngram-k8"])
def test_the_plugins_unions_equal_the_recorders_recount_and_the_oracle(client, record_dir, receiver, oracle,
                                                                      replies, span_means, policy):
    """Their engines have stopped by now, so SGLang's recorder has dumped everything they ran."""
    paddings = check_against_the_recorder(record_dir, receiver, oracle, replies[policy.policy_id], policy,
                                          client.model_info(), span_means)
    if policy.drafter is Drafter.NGRAM:  # windows with a full match and windows padded where it found less
        assert paddings[0] > 0 and sum(n for pad, n in paddings.items() if pad > 0) > 0


@pytest.mark.parametrize("policy", [K3, NGRAM4], ids=["model-k3", "ngram-k4"])
def test_whatif_replays_the_step_recording(steps_file, span_means, replies, tmp_path, policy):
    from service.recording import read_recording

    recording = read_recording(steps_file)
    # Every request so far (plain, k=3, ngram k=4, plain again), none rebuilt from counts alone.
    recorded = Counter(s.policy_id for r in recording.requests for s in r[:1])
    assert all(recorded[p.policy_id] == len(replies[p.policy_id]) for p in (K3, NGRAM4, NGRAM8))
    assert recorded["plain"] > 0 and recorded[PLAIN.policy_id] == len(PROMPTS)
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
    # Both backends serve requests in shared passes and report each request's mean batch union.
    assert set(request_span["attributes"]) == set(their_request["attributes"])
    assert set(request_span["attributes"]) >= set(a.REQUEST_SPAN_KEYS)
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
