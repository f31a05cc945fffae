"""GPU check of the SGLang backend through the real gRPC server (used by scripts/gpu_check*.sh).

Starts `moespec serve --backend sglang` as a subprocess with its OTLP exporter pointed at an
in-process receiver, sets each draft policy through PolicyAdmin, sends greedy requests through
Inference.Generate, checks every response's stats and the spans, and prints one table:
tokens/s, accept length, per-layer unique experts, and how long the first request after a policy
change took (the engine swap). Exit 1 on a failed check, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from otel.receiver import OtlpTraceReceiver  # noqa: E402
from service.server.client import MoespecClient  # noqa: E402
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams  # noqa: E402

TOKEN = "gpu-check-token"
PROMPTS = ROOT / "service" / "prompts" / "heldout.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="sglang", help="torch: dry-run this script on the embedded engine (CPU)")
    ap.add_argument("--model-path")
    ap.add_argument("--draft-model-path")
    ap.add_argument("--speculative-algorithm", default="STANDALONE")
    ap.add_argument("--lengths", default="0,2,4", help="model-drafter draft lengths to measure, in order")
    ap.add_argument("--ngram-length", type=int, default=4, help="also measure the n-gram drafter (0 = skip)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt", default=None, help="one prompt for every request (default: the shipped set)")
    ap.add_argument("--no-spans", action="store_true", help="do not require spans (telemetry not wired)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `moespec serve` argument")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    if args.backend == "sglang" and not args.model_path:
        ap.error("--model-path is required with --backend sglang")

    policies = [DraftPolicy(Drafter.MODEL, int(k), policy_id=f"model-k{k}") for k in args.lengths.split(",")]
    if args.ngram_length:
        policies.append(DraftPolicy(Drafter.NGRAM, args.ngram_length, policy_id=f"ngram-k{args.ngram_length}"))
    prompts = [args.prompt] * args.requests if args.prompt else _prompts(args.requests)

    with OtlpTraceReceiver() as receiver:
        server, address = _serve(args, receiver.endpoint)
        try:
            figures, failures = _measure(address, policies, prompts, args.max_new_tokens, args.backend)
        finally:
            server.terminate()
            server.wait(60)
        if not args.no_spans:
            failures += _check_spans(receiver, policies)
    _print(figures)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    for f in failures:
        print("FAIL:", f)
    print("gpu check:", "FAILED" if failures else "passed")
    return 1 if failures else 0


def _prompts(n: int) -> list[str]:
    lines = PROMPTS.read_text().splitlines()
    return [json.loads(lines[i % len(lines)])["prompt"] for i in range(n)]


def _serve(args, endpoint: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "service.cli", "serve", "--backend", args.backend, "--port", "0",
           "--admin-token", TOKEN, *args.serve_arg]
    if args.backend == "sglang":
        cmd += ["--model-path", args.model_path, "--speculative-algorithm", args.speculative_algorithm]
        if args.draft_model_path:
            cmd += ["--draft-model-path", args.draft_model_path]
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
               OTEL_TRACES_SAMPLER="always_on", OTEL_BSP_SCHEDULE_DELAY="200")
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the server prints one line once it accepts requests
        print("  server:", line.rstrip(), flush=True)
        if line.startswith("moespec serving on "):
            return proc, line.split()[-1]
    raise SystemExit(f"the server exited with {proc.wait()} before serving")


def _measure(address: str, policies: list[DraftPolicy], prompts: list[str], max_new: int, backend: str):
    figures, failures, baseline = [], [], None
    with MoespecClient(address, admin_token=TOKEN) as client:
        client.wait_ready(timeout=600)
        info = client.model_info()
        if info.backend != backend:
            failures.append(f"ModelInfo.backend is {info.backend!r}")
        if backend == "sglang" and "draft_temperature" in info.tunable:
            failures.append("draft_temperature is listed as tunable")
        for policy in policies:
            client.set_policy(policy)
            replies, walls = [], []
            for prompt in prompts:
                t0 = time.perf_counter()
                replies.append(client.generate(GenerationRequest(prompt=prompt, max_new_tokens=max_new,
                                                                 sampling=SamplingParams(temperature=0.0)),
                                               timeout=900))
                walls.append(time.perf_counter() - t0)
            failures += _check(policy, replies, info)
            if policy.draft_length == 0:
                baseline = [r.token_ids for r in replies]
            elif baseline is not None and policy.drafter is Drafter.MODEL:
                same = sum(a == r.token_ids for a, r in zip(baseline, replies, strict=True))
                print(f"  greedy outputs equal to plain decoding at {policy.policy_id}: {same}/{len(replies)}")
            figures.append(_figures(policy, replies, walls, info))
    return figures, failures


def _check(policy: DraftPolicy, replies, info) -> list[str]:
    bad, k, m, E = [], policy.draft_length, info.top_k, info.num_experts
    # SGLang: the prefill makes the first token and every verify pass drafts all k (NGRAM pads);
    # the embedded engine makes every token in a step and drafts fewer near the budget or no match.
    sglang = info.backend == "sglang"
    for i, r in enumerate(replies):
        s, where = r.spec, f"{policy.policy_id} request {i}"
        if s.policy_id != policy.policy_id:
            bad.append(f"{where}: spec.policy_id {s.policy_id!r}")
        if s.verify_steps < 1 or s.committed_tokens != r.completion_tokens - int(sglang):
            bad.append(f"{where}: {s.verify_steps} steps committed {s.committed_tokens} "
                       f"of {r.completion_tokens} tokens")
        drafted_ok = s.drafted_tokens == s.verify_steps * k if sglang else s.drafted_tokens <= s.verify_steps * k
        if not drafted_ok or s.accepted_tokens > s.drafted_tokens:
            bad.append(f"{where}: drafted {s.drafted_tokens} accepted {s.accepted_tokens} in {s.verify_steps} steps")
        if len(s.unique_experts_max) != info.num_layers:
            bad.append(f"{where}: {len(s.unique_experts_max)} layers of unique experts, not {info.num_layers}")
        elif not all(m <= u <= min(E, (k + 1) * m) for u in s.unique_experts_max):
            bad.append(f"{where}: unique experts {s.unique_experts_max} outside [{m}, {min(E, (k + 1) * m)}]")
    return bad


def _figures(policy: DraftPolicy, replies, walls, info) -> dict:
    steps = sum(r.spec.verify_steps for r in replies)
    layers = range(info.num_layers)
    return {
        "policy": policy.policy_id,
        "tokens_per_s": sum(r.completion_tokens for r in replies[1:]) / max(1e-9, sum(walls[1:])),
        "first_request_s": walls[0],  # includes the engine swap this policy needed
        "median_request_s": sorted(walls)[len(walls) // 2],
        "accept_length": sum(r.spec.committed_tokens for r in replies) / max(1, steps),
        "accepted_per_step": sum(r.spec.accepted_tokens for r in replies) / max(1, steps),
        "unique_experts_mean": [sum(r.spec.unique_experts_mean[i] * r.spec.verify_steps for r in replies)
                                / max(1, steps) for i in layers],
        "unique_experts_max": [max(r.spec.unique_experts_max[i] for r in replies) for i in layers],
        "seconds_per_committed_token": sum(r.spec.draft_seconds + r.spec.verify_seconds for r in replies)
        / max(1, sum(r.spec.committed_tokens for r in replies)),
    }


def _check_spans(receiver: OtlpTraceReceiver, policies: list[DraftPolicy]) -> list[str]:
    want = {p.policy_id for p in policies}

    def seen(spans):
        return want <= {s["attributes"].get("moespec.spec.policy_id") for s in spans}

    try:
        spans = receiver.wait_for(seen, timeout=30)
    except TimeoutError:
        spans = receiver.spans
        got = {s["attributes"].get("moespec.spec.policy_id") for s in spans} - {None}
        return [f"request spans for policies {sorted(want - got)} never arrived ({len(spans)} spans received)"]
    bad = []
    requests = [s for s in spans if s["name"].startswith("text_completion")]
    for s in requests:
        a = s["attributes"]
        if a.get("gen_ai.provider.name") is None or "moespec.moe.unique_experts_mean" not in a:
            bad.append(f"request span {s['span_id']} lacks gen_ai / moespec attributes")
            break
    verify = [s for s in spans if s["name"] == "verify"]
    print(f"  spans: {len(requests)} request spans, {len(verify)} verify spans")
    return bad


def _print(figures: list[dict]) -> None:
    print(f"{'policy':<12} {'tok/s':>8} {'first s':>8} {'accept':>7} {'acc/step':>8}  "
          "unique experts mean (max) per layer")
    for f in figures:
        layers = " ".join(f"{m:5.1f}({x})" for m, x in zip(f["unique_experts_mean"], f["unique_experts_max"],
                                                            strict=True))
        print(f"{f['policy']:<12} {f['tokens_per_s']:8.1f} {f['first_request_s']:8.2f} {f['accept_length']:7.2f} "
              f"{f['accepted_per_step']:8.2f}  {layers}")


if __name__ == "__main__":
    sys.exit(main())
