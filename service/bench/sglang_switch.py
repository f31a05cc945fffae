"""What a draft-length change costs on the SGLang backend, under load: prepared lengths (the adaptive
EAGLE engine, pinned at run time) against engine swaps (`--sglang-prepared-lengths none`).

    moespec bench sglang-switch [--rounds 2] [--switches 4] [--clients 4] [--tune-trials 10]   (SGLang venv)

Each round starts one EAGLE3 server per mode (the shipped target and EAGLE-3 draft, `moespec serve`
defaults otherwise; the modes' order alternates between rounds), runs --clients closed-loop greedy
clients on it, and changes the draft length --switches times (k = 2 <-> 4, each change a new policy id).
Per change: SetPolicy's own time, then one greedy request sent as SetPolicy returns, the time to its
first token and to its reply (which must carry the new policy id), and the load's failed requests.
With --tune-trials N, `moespec tune`'s loop (TPE, draft lengths only, its default windows) then runs N
trials against the prepared server under the same load, timed. Writes sglang_switch.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from service.bench.sglang import STAND_IN
from service.bench.sglang_batching import child_env, cpu_name, serve_flags
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams

TOKEN = "bench-sglang-switch"
MODES = {"prepared": (), "swapped": ("--sglang-prepared-lengths", "none")}
LENGTHS = (4, 2)  # the lengths the changes alternate between; the server starts at the second
PROBE_TOKENS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--switches", type=int, default=4, help="draft-length changes per server")
    parser.add_argument("--clients", type=int, default=4, help="closed-loop load clients during the changes")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="per load request")
    parser.add_argument("--tune-trials", type=int, default=0,
                        help="then time this many tuner trials (draft lengths only) against the prepared server")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--stand-in", type=Path, default=STAND_IN,
                        help="directory put on the children's PYTHONPATH on --device cpu (sgl-kernel CPU ops)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-sglang-switch"))


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from service.errors import UsageError

    if min(args.rounds, args.switches, args.clients, args.max_new_tokens) < 1 or args.tune_trials < 0:
        raise UsageError("--rounds, --switches, --clients and --max-new-tokens must be >= 1, --tune-trials >= 0")
    if importlib.util.find_spec("sglang") is None:
        raise UsageError("bench sglang-switch needs sglang in this environment: run the moespec of the SGLang "
                         "venv (bash scripts/setup_sglang_cpu.sh builds ~/.cache/moespec/sglang-venv)")
    rounds = []
    for r in range(args.rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        figures = {mode: measure(mode, args, tune=args.tune_trials if mode == "prepared" and r == 0 else 0)
                   for mode in order}
        rounds.append({"order": order, **figures})
        print(f"round {r + 1}: " + json.dumps({m: summary_of(f["changes"]) for m, f in figures.items()}),
              file=sys.stderr, flush=True)
    result = {"device": args.device, "cpu": cpu_name(), "clients": args.clients, "switches": args.switches,
              "max_new_tokens": args.max_new_tokens, "rounds": rounds,
              "summary": {mode: summary_of([c for r in rounds for c in r[mode]["changes"]]) for mode in MODES},
              "tune": rounds[0]["prepared"].get("tune")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sglang_switch.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (args.out / "sglang_switch.md").write_text(table)
    print(table)
    print(f"wrote {args.out}/sglang_switch.json, .md")
    return 0


def measure(mode: str, args: argparse.Namespace, tune: int) -> dict:
    from service.server.client import MoespecClient
    from tuner.drivers.loadgen import LoadGenerator, LoadSpec
    from tuner.drivers.server_proc import start_server, telemetry_env

    receiver, collector = open_receiver() if tune else (None, None)
    env = {**child_env(args), **(telemetry_env(receiver.endpoint) if receiver else {})}
    flags = ("--backend", "sglang", *serve_flags(args), "--speculative-algorithm", "EAGLE3", "--sglang-no-ngram",
             "--drafter", "model", "--draft-length", str(LENGTHS[1]), *MODES[mode])
    server = start_server(env, TOKEN, flags, ready_timeout=900)
    stop = threading.Event()
    try:
        with MoespecClient(server.address, admin_token=TOKEN) as client:
            client.wait_ready(timeout=120)
            from service.bench.engine import load_prompts

            prompts = load_prompts(8)
            load = LoadGenerator(client, prompts, LoadSpec(concurrency=args.clients,
                                                           max_new_tokens=args.max_new_tokens))
            thread = threading.Thread(target=load.run, args=(stop,), daemon=True)
            thread.start()
            time.sleep(2.0)  # the load is running before the first change
            changes = [change(client, LENGTHS[i % 2], f"{mode}-{i}", prompts[i % len(prompts)])
                       for i in range(args.switches)]
            out = {"changes": changes}
            if tune:
                out["tune"] = run_tuner(client, server.address, collector, tune)
            stop.set()
            thread.join(timeout=600)
            summary = load.summary()
            info = client.model_info()
        out.update(load_ok=summary.ok, load_errors=dict(summary.errors), engine_swaps=info.policy_switches,
                   length_pins=info.length_switches)
        return out
    finally:
        stop.set()
        server.stop(timeout=120)
        if receiver is not None:
            receiver.stop(0.5)


def change(client, k: int, policy_id: str, prompt: str) -> dict:
    """SetPolicy to draft length k, then one greedy request: the time to its first token and its reply."""
    t0 = time.perf_counter()
    client.set_policy(DraftPolicy(drafter=Drafter.MODEL, draft_length=k, policy_id=policy_id))
    set_seconds = time.perf_counter() - t0
    request = GenerationRequest(prompt=prompt, max_new_tokens=PROBE_TOKENS, sampling=SamplingParams(temperature=0.0))
    first, reply = None, None
    for chunk in client.stream(request, timeout=900):
        first = first or time.perf_counter() - t0
        reply = chunk.reply or reply
    reply_seconds = time.perf_counter() - t0
    ran_under = reply.spec.policy_id if reply is not None and reply.spec is not None else None
    if ran_under != policy_id:
        raise RuntimeError(f"the request after SetPolicy({policy_id}) ran under {ran_under!r}")
    return {"k": k, "set_policy_s": set_seconds, "first_token_s": first, "reply_s": reply_seconds}


def open_receiver():
    from otel.receiver import OtlpTraceReceiver
    from tuner.measurement.collector import SpanCollector
    from tuner.measurement.spans import request_sample

    collector = SpanCollector(request_sample)
    receiver = OtlpTraceReceiver("127.0.0.1", 0, on_spans=collector.on_spans)
    receiver.start()
    return receiver, collector


def run_tuner(client, address: str, collector, trials: int) -> dict:
    """`moespec tune`'s loop (the CLI's initial design) for `trials` trials: wall time and what it did."""
    import tempfile

    import optuna

    from tuner.drivers.progress import ProgressPrinter
    from tuner.loop.assemble import TuneSettings, assemble
    from tuner.loop.sampler import InitialDesign
    from tuner.loop.space import LengthOnly
    from tuner.loop.study import open_storage
    from tuner.measurement.admin import PolicyAdmin

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    before = client.model_info()
    with tempfile.TemporaryDirectory() as tmp:
        storage = open_storage(f"sqlite:///{tmp}/tune.db")
        # Draft lengths only (chains): what prepared lengths make cheap; trees are engines of their own.
        settings = TuneSettings(study_name="switch", trials=trials, tuner_id="bench:sglang-switch",
                                initial_design=InitialDesign.CORNERS, restrict=LengthOnly(Drafter.MODEL))
        built = assemble(settings, storage, PolicyAdmin(client, address), collector, ProgressPrinter(sys.stderr))
        t0 = time.monotonic()
        best = built.tuner.run()
        seconds = time.monotonic() - t0
        finished = sum(t.state == optuna.trial.TrialState.COMPLETE for t in built.study.trials)
        pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in built.study.trials)
    after = client.model_info()
    return {"trials": trials, "seconds": round(seconds, 1), "complete": finished, "pruned": pruned,
            "pick": best.key.label(), "engine_swaps": after.policy_switches - before.policy_switches,
            "length_pins": after.length_switches - before.length_switches}


def summary_of(changes: list[dict]) -> dict:
    def spread(key: str) -> dict:
        values = [c[key] for c in changes]
        return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                "max": round(max(values), 3)}

    return {key: spread(key) for key in ("set_policy_s", "first_token_s", "reply_s")}


def markdown(result: dict) -> str:
    lines = [f"SGLang backend, EAGLE3 (shipped target and draft), {result['clients']} load clients, "
             f"{result['switches']} draft-length changes (k = 2 <-> 4) per server and round, "
             f"{len(result['rounds'])} rounds; {result['cpu']}.", "",
             "| mode | SetPolicy | first token after it | reply after it | engine swaps | pins | failed requests |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    def cell(spread: dict) -> str:
        return f"{spread['median']:.3f} s ({spread['min']:.3f}-{spread['max']:.3f})"

    for mode in MODES:
        s = result["summary"][mode]
        runs = [r[mode] for r in result["rounds"]]
        lines.append(f"| {mode} | {cell(s['set_policy_s'])} | {cell(s['first_token_s'])} | {cell(s['reply_s'])} | "
                     f"{sum(r['engine_swaps'] for r in runs)} | {sum(r['length_pins'] for r in runs)} | "
                     f"{sum(sum(r['load_errors'].values()) for r in runs)} |")
    tune = result.get("tune")
    if tune:
        lines += ["", f"Tuner, {tune['trials']} trials (draft lengths only) against the prepared server under the "
                      f"same load: {tune['seconds']} s ({tune['complete']} complete, {tune['pruned']} pruned; "
                      f"{tune['engine_swaps']} engine swaps, {tune['length_pins']} pins), pick {tune['pick']}."]
    return "\n".join(lines) + "\n"
