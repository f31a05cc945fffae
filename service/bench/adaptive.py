"""`moespec bench adaptive`: draft-length controllers on a mixed workload, through `moespec serve`.

The workload a real service sees: phases that switch between 1 and 16 clients (--phase-seconds
each), requests drawn in turn from the held-out code prompts and the repeat prompts, half greedy,
half sampled (T=0.8, top-p 0.95). One server at its default flags; each contender is set with
SetPolicy and runs the whole phase schedule. First an exhaustive static grid runs the schedule
once each, and its best (highest tokens/s over the schedule) joins the contenders; then
--rounds rounds run every contender, each round in another order (interleaved, so drift hits all
alike; a Williams design, so no contender always follows the same one). Reported per contender:
tokens/s over the schedule and per phase (median and spread over rounds), what it drafted per
phase, and per-round paired ratios against plain, the best static policy and each baseline.

The rule's own overhead is timed in-process: plan + observe of the moespec controller and the
pass bookkeeping on a fitted state, per step (drafting every step), against the server's plain
decode step: its calibrated forward alone, and the whole step as the server ran it in plain's
one-client phases (the replies' seconds after the first token over their steps after it: the
forward, the acceptance, the records and the streaming of every step).

Writes adaptive.json, adaptive.md and adaptive.png to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from service.server.client import MoespecClient
from service.types import Controller, Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tuner.drivers.loadgen import DEFAULT_PROMPTS, REPEAT_PROMPTS, load_prompts
from tuner.drivers.server_proc import start_server

ADMIN_TOKEN = "bench-adaptive-admin-token"
# Plain decoding again, as its own contender: how far two runs of one policy land apart per phase on
# this machine (the noise floor the per-phase ratios are read against).
PLAIN_AGAIN = "plain, run twice"
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)


def grid(max_length: int) -> dict[str, DraftPolicy]:
    """The static policies the best static one is chosen from."""
    policies = {"plain": DraftPolicy(draft_length=0)}
    for k in (2, 4, max_length):
        policies[f"ngram k={k}"] = DraftPolicy(Drafter.NGRAM, k)
    for k in (2, 4):
        policies[f"model k={k} T=0"] = DraftPolicy(Drafter.MODEL, k, 0.0)
    return policies


def controllers(drafter: Drafter, max_length: int) -> dict[str, DraftPolicy]:
    temperature = 0.0  # greedy drafts for the model drafter (what the grid's model policies use)
    return {c.value: DraftPolicy(drafter, max_length, temperature, controller=c)
            for c in (Controller.SGLANG, Controller.TRANSFORMERS, Controller.CASCADE, Controller.MOESPEC)}


@dataclass(frozen=True)
class PhaseResult:
    clients: int
    seconds: float
    tokens: int
    requests: int
    # what the contender's speculation did in the phase (the replies' SpecStats, summed): how much it
    # drafted tells a controller that kept plain from one that drafted and lost
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    empty_drafts: int = 0  # steps that asked the drafter and got nothing (an n-gram lookup without a match)
    decode_seconds: float = 0.0  # the server's seconds after each request's first token, summed: its steps'

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Workload:
    """Requests in a fixed order: code and repeat prompts alternating, greedy and sampled alternating."""

    def __init__(self, max_new_tokens: int):
        code, repeat = load_prompts(DEFAULT_PROMPTS), load_prompts(REPEAT_PROMPTS)
        mixed = [p for pair in zip(code, repeat, strict=False) for p in pair]
        self.requests = [GenerationRequest(prompt=p, max_new_tokens=max_new_tokens,
                                           sampling=GREEDY if i % 2 == 0 else SAMPLED)
                         for i, p in enumerate(mixed)]
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> GenerationRequest:
        with self._lock:
            request = self.requests[self._next % len(self.requests)]
            self._next += 1
            return request

    def rewind(self) -> None:
        with self._lock:
            self._next = 0


def run_phase(client: MoespecClient, workload: Workload, clients: int, seconds: float) -> PhaseResult:
    """`clients` callers back to back until the deadline; the requests in flight then finish and count."""
    deadline = time.perf_counter() + seconds
    # tokens, requests, verify steps, drafted, accepted, empty drafts, decode seconds
    counts, lock = [0] * 7, threading.Lock()

    def caller() -> None:
        while time.perf_counter() < deadline:
            reply = client.generate(workload.take(), timeout=120)
            spec = reply.spec
            with lock:
                for i, n in enumerate((reply.completion_tokens, 1, spec.verify_steps, spec.drafted_tokens,
                                       spec.accepted_tokens, spec.empty_drafts,
                                       reply.seconds - reply.time_to_first_token)):
                    counts[i] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=caller) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return PhaseResult(clients, time.perf_counter() - t0, *counts)


def run_schedule(client: MoespecClient, admin: MoespecClient, policy: DraftPolicy, workload: Workload,
                 phases: list[int], seconds: float) -> list[PhaseResult]:
    admin.set_policy(policy)
    workload.rewind()  # every contender serves the same requests in the same order
    return [run_phase(client, workload, clients, seconds) for clients in phases]


def round_order(n: int, r: int) -> list[int]:
    """Round r's order of n contenders: a Williams design, so that no contender always runs after the
    same one (a plain rotation keeps every neighbour, and what a run leaves behind, e.g. a heavily
    drafting contender's garbage and caches, then weighs on one contender only). The base sequence
    0, 1, n-1, 2, n-2, ... shifted by r; from round n on, mirrored (for odd n the two squares
    together balance each ordered pair of neighbours)."""
    base, low, high = [0], 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    order = [(b + r) % n for b in base]
    return order[::-1] if (r // n) % 2 else order


def overall(results: list[PhaseResult]) -> float:
    """Tokens/s over the schedule: each phase weighs by its time, as a service's clock does."""
    return sum(r.tokens for r in results) / sum(r.seconds for r in results)


def rule_overhead(plain_step_seconds: float, steps: int = 20000) -> dict[str, float]:
    """Seconds the moespec controller's per-step work costs (plan, observe, the pass bookkeeping)."""
    from service.engine.spec.adaptive.controller import StepOutcome
    from service.engine.spec.adaptive.state import AdaptiveState

    state = AdaptiveState(64, 8, plain_step_seconds)
    policy = DraftPolicy(Drafter.NGRAM, 8, controller=Controller.MOESPEC)
    rule = state.controller_for(policy)
    context = state.context(1, 0)
    t0 = time.perf_counter()
    for i in range(steps):
        k = rule.plan(context, 8)
        accepted = i % (k + 1)
        rule.observe(StepOutcome(k, accepted, plain_step_seconds, accepted + 1, None, planned=k))
        state.observe_pass(k + 1, 8.0 + 4 * k, plain_step_seconds * (1 + 0.1 * k))
    per_step = (time.perf_counter() - t0) / steps
    return {"seconds_per_step": per_step, "plain_step_seconds": plain_step_seconds,
            "share_of_plain_step": per_step / plain_step_seconds}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired(rounds: list[dict[str, float]], a: str, b: str) -> dict[str, float]:
    return spread([r[a] / r[b] for r in rounds if r.get(b)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every contender (default 5)")
    parser.add_argument("--phase-seconds", type=float, default=20.0, help="seconds per phase (default 20)")
    parser.add_argument("--phases", type=int, nargs="+", default=[1, 16, 1, 16],
                        help="clients per phase, in order (default 1 16 1 16)")
    parser.add_argument("--drafter", choices=[d.value for d in Drafter], default=Drafter.NGRAM.value,
                        help="the adaptive controllers' drafter (default ngram)")
    parser.add_argument("--max-draft-length", type=int, default=8, help="the controllers' most (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--serve-args", default="", help="extra `moespec serve` flags (default: none)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-adaptive"))


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    workload = Workload(args.max_new_tokens)
    server = start_server({}, ADMIN_TOKEN, tuple(args.serve_args.split()))
    try:
        with MoespecClient(server.address) as client, MoespecClient(server.address, admin_token=ADMIN_TOKEN) as admin:
            result = measure(args, client, admin, workload)
    finally:
        server.stop()
    (args.out / "adaptive.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (args.out / "adaptive.md").write_text(md)
    plot(result, args.out / "adaptive.png")
    print(md)
    return 0


def measure(args, client: MoespecClient, admin: MoespecClient, workload: Workload) -> dict:
    info = client.model_info()
    schedule = (args.phases, args.phase_seconds)
    print(f"grid: {len(grid(args.max_draft_length))} static policies, {len(args.phases)} phases of "
          f"{args.phase_seconds:g} s each", flush=True)
    grid_runs = {}
    for name, policy in grid(args.max_draft_length).items():
        grid_runs[name] = [asdict(r) | {"tokens_per_second": r.tokens_per_second}
                           for r in run_schedule(client, admin, policy, workload, *schedule)]
        print(f"  {name}: {overall([PhaseResult(**_fields(r)) for r in grid_runs[name]]):.1f} tok/s", flush=True)
    best = max(grid_runs, key=lambda n: overall([PhaseResult(**_fields(r)) for r in grid_runs[n]]))
    best_name = f"best static ({best})"
    plain_name = "plain" if best != "plain" else best_name
    contenders = {"plain": DraftPolicy(draft_length=0)} if best != "plain" else {}
    contenders[best_name] = grid(args.max_draft_length)[best]
    contenders.update(controllers(Drafter(args.drafter), args.max_draft_length))
    contenders[PLAIN_AGAIN] = DraftPolicy(draft_length=0)
    names = list(contenders)
    rounds, phases, drafting = [], {n: [] for n in names}, {n: [] for n in names}
    for r in range(args.rounds):
        order = [names[i] for i in round_order(len(names), r)]
        this = {}
        for name in order:
            results = run_schedule(client, admin, contenders[name], workload, *schedule)
            this[name] = overall(results)
            phases[name].append([x.tokens_per_second for x in results])
            drafting[name].append([asdict(x) for x in results])
        rounds.append(this)
        print(f"round {r + 1}: " + ", ".join(f"{n} {this[n]:.1f}" for n in names), flush=True)
    admin.set_policy(DraftPolicy(policy_id="default"))
    summary = {}
    for name in names:
        values = [r[name] for r in rounds]
        per_phase = list(zip(*phases[name], strict=True))
        summary[name] = {
            "tokens_per_second": spread(values),
            "per_phase_median": [statistics.median(p) for p in per_phase],
            "drafts_per_step_per_phase_median": [statistics.median(r["drafted_tokens"] / max(1, r["verify_steps"])
                                                         for r in p)
                                                 for p in zip(*drafting[name], strict=True)],
            "vs_plain": paired(rounds, name, plain_name),
            "per_phase_vs_plain": [spread([x / p for x, p in zip(mine, plains, strict=True)])
                                   for mine, plains in zip(per_phase, zip(*phases[plain_name], strict=True),
                                                           strict=True)],
            "vs_best_static": paired(rounds, name, best_name),
            "policy": {k: str(v) for k, v in asdict(contenders[name]).items()},
        }
    baselines = [c.value for c in (Controller.SGLANG, Controller.TRANSFORMERS, Controller.CASCADE)]
    summary[Controller.MOESPEC.value]["vs_baselines"] = {b: paired(rounds, Controller.MOESPEC.value, b)
                                                        for b in baselines}
    def worst_phase(name: str) -> list[float]:  # per round: the contender's lowest phase ratio against plain
        return [min(x / p for x, p in zip(m, pl, strict=True))
                for m, pl in zip(phases[name], phases[plain_name], strict=True)]
    overhead = rule_overhead(info.decode_step_seconds)
    alone = [i for i, c in enumerate(args.phases) if c == 1]
    if alone:  # a plain step as the server ran it for one client (a request's first step is its first token's)
        served = statistics.median(r[i]["decode_seconds"] / max(1, r[i]["verify_steps"] - r[i]["requests"])
                                   for r in drafting[plain_name] for i in alone)
        overhead |= {"served_step_seconds": served, "share_of_served_step": overhead["seconds_per_step"] / served}
    return {
        "settings": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")},
        "server": {"backend": info.backend, "decode_step_seconds": info.decode_step_seconds},
        "phases": args.phases, "phase_seconds": args.phase_seconds,
        "grid": grid_runs, "best_static": best, "rounds": rounds, "per_phase": phases, "phase_counts": drafting,
        "summary": summary,
        "moespec_worst_phase_vs_plain_per_round": worst_phase(Controller.MOESPEC.value),
        "plain_again_worst_phase_vs_plain_per_round": worst_phase(PLAIN_AGAIN),
        "rule_overhead": overhead,
    }


def _fields(row: dict) -> dict:
    return {k: row[k] for k in PhaseResult.__dataclass_fields__ if k in row}


def markdown(result: dict) -> str:
    s = result["summary"]
    phases = " / ".join(f"{c}" for c in result["phases"])
    lines = [f"Workload: phases of {phases} clients, {result['phase_seconds']:g} s each; "
             f"best static of the grid: {result['best_static']}.", "",
             "| contender | tokens/s (median, spread) | per phase (median) | drafts per step, per phase | "
             "vs plain | vs best static |",
             "|---|---:|---|---|---:|---:|"]

    def ratio(d: dict) -> str:
        return f"{d['median']:.3f}x [{d['min']:.3f}, {d['max']:.3f}]"

    for name, row in s.items():
        t = row["tokens_per_second"]
        per_phase = " / ".join(f"{x:.0f}" for x in row["per_phase_median"])
        drafts = " / ".join(f"{x:.2f}" for x in row["drafts_per_step_per_phase_median"])
        lines.append(f"| {name} | {t['median']:.1f} [{t['min']:.1f}, {t['max']:.1f}] | {per_phase} | {drafts} | "
                     f"{ratio(row['vs_plain'])} | {ratio(row['vs_best_static'])} |")
    lines += ["", "moespec's rule against each baseline (per-round ratio):", ""]
    for b, d in s[Controller.MOESPEC.value]["vs_baselines"].items():
        lines.append(f"- {b}: {ratio(d)}")
    lines += ["", "Each phase against plain (per-round ratio), moespec's rule and plain's second run (the noise "
              "floor):", ""]
    for name in (Controller.MOESPEC.value, PLAIN_AGAIN):
        by_phase = "; ".join(f"{c} client{'s' if c > 1 else ''} {ratio(d)}"
                             for c, d in zip(result["phases"], s[name]["per_phase_vs_plain"], strict=True))
        lines.append(f"- {name}: {by_phase}")
    worst = result["moespec_worst_phase_vs_plain_per_round"]
    again = result["plain_again_worst_phase_vs_plain_per_round"]
    o = result["rule_overhead"]
    lines += ["", f"moespec's worst phase against plain, per round: {', '.join(f'{x:.3f}' for x in worst)}",
              f"plain's second run, its worst phase against plain, per round: {', '.join(f'{x:.3f}' for x in again)}",
              f"Rule overhead: {o['seconds_per_step'] * 1e6:.1f} us per step, {o['share_of_plain_step'] * 100:.2f}% "
              f"of a plain step's forward ({o['plain_step_seconds'] * 1e3:.3f} ms)"
              + (f", {o['share_of_served_step'] * 100:.2f}% of a whole plain step as the server ran it for one "
                 f"client ({o['served_step_seconds'] * 1e3:.3f} ms)." if "served_step_seconds" in o else "."), ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for name in result["summary"]:
        values = [r[name] for r in result["rounds"]]
        ax.plot(range(1, len(values) + 1), values, marker="o", label=name)
    ax.set(xlabel="round (interleaved)", ylabel="tokens/s over the schedule", ylim=(0, None),
           title="Draft-length controllers on a 1 / 16 client workload")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
