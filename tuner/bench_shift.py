"""`moespec bench tuner --scenario shift`: the continuous tuner under a workload shift, a no-shift
control, and what its exploration costs.

Two runs, each on a fresh server, the continuous tuner (tuner/continuous.py) in a thread:
- shift: the load serves the code prompts; once the initial search has decided and the tuner has
  explored for --steady-seconds, the load switches to `service/prompts/repeat.jsonl` (answers repeat
  the prompt: prompt lookup shines). Reported: seconds from the switch to the re-opened search and
  to the new incumbent, and the new incumbent measured side by side on the new workload against the
  old incumbent, plain decoding and n-gram k=max.
- no-shift: the same, the load never switches; reported: re-opened searches (should be 0).
  Exploration cost: output tokens/s with the tuner exploring vs the incumbent alone, alternating
  --steady-seconds periods (two pairs), so drift hits both.
Writes shift.json / shift.md to --out and prints the table.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import optuna

from service.types import Drafter, DraftPolicy
from tuner.assemble import TuneSettings, assemble
from tuner.compare import compare
from tuner.continuous import ContinuousConfig, ContinuousTuner, Decision
from tuner.measure import MeasureConfig, Measurer
from tuner.progress import ProgressPrinter
from tuner.pruning import PruneRule
from tuner.rig import Rig, RigSpec, open_rig
from tuner.sampler import InitialDesign
from tuner.space import policy_key
from tuner.study import open_storage
from tuner.window import CostModel, Objective, WindowSpec


def run_shift(args, code: list[str], repeat: list[str], out: Path) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    result: dict[str, object] = {"settings": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")}}
    for label, shift in (("shift", True), ("no-shift", False)):
        spec = RigSpec(code, args.concurrency, args.max_new_tokens, args.temperature, args.seed, args.threads)
        with open_rig(spec) as rig:
            result[label] = one_run(args, rig, label, repeat if shift else None, out)
    (out / "shift.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = markdown(result)
    (out / "shift.md").write_text(md)
    print(md)
    return 0


class _Running:
    """The continuous tuner in a thread that can be stopped and started again (a restart keeps the
    saved incumbent, so an exploring / alone alternation measures the same incumbent)."""

    def __init__(self, tuner: ContinuousTuner):
        self.tuner = tuner
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.tuner.run, args=(self._stop,), daemon=True, name="continuous")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(600)
        self.tuner.restore()


def one_run(args, rig: Rig, label: str, new_prompts: list[str] | None, out: Path) -> dict[str, object]:
    err = sys.stderr
    storage = open_storage(f"sqlite:///{(out / f'{label}.db').resolve()}")
    window = WindowSpec(args.min_tokens, args.min_steps, args.max_window_seconds)
    decisions: list[Decision] = []

    def on_decision(d: Decision) -> None:
        decisions.append(d)
        print(f"bench {label}: decision {d.kind}: {d.policy} ({d.reason})", file=err, flush=True)

    base = TuneSettings(study_name=label, trials=args.trials, tuner_id=f"bench:{label}", seed=args.seed,
                        window=window, remeasure_top=args.remeasure, initial_design=InitialDesign(args.initial_design))
    root = assemble(base, storage, rig.admin, rig.collector, ProgressPrinter(err))

    def make(name: str, trials: int):
        if name == label:
            return root
        return assemble(replace(base, study_name=name, trials=trials), storage, rig.admin, rig.collector,
                        ProgressPrinter(err))

    config = ContinuousConfig(exploration_share=args.exploration_share, reopen_trials=args.reopen_trials,
                              idle_seconds=1.0, max_idle_seconds=8.0)
    running = _Running(ContinuousTuner(root.study, make, config, args.trials, None, on_decision))
    t0 = time.monotonic()
    running.start()
    wait_for(lambda: bool(decisions), args.shift_timeout)
    searched = time.monotonic() - t0
    before = running.tuner.incumbent
    r: dict[str, object] = {"initial_search_seconds": round(searched, 1),
                            "incumbent_before": before.key.label() if before else None}
    if new_prompts is None:
        time.sleep(args.steady_seconds)
        running.stop()
        r["exploration"] = exploration_cost(args, rig, running)
        running.stop()
    else:
        time.sleep(args.steady_seconds)
        seen = len(decisions)
        rig.switch_prompts(new_prompts)
        switched = time.time()  # Decision.at is wall time
        wait_for(lambda: any(d.kind == "reopen" for d in decisions[seen:]), args.shift_timeout)
        reopened = next((d for d in decisions[seen:] if d.kind == "reopen"), None)
        r["seconds_to_reopen"] = round(reopened.at - switched, 1) if reopened else None
        wait_for(lambda: any(d.kind == "initial" and d.epoch > 0 for d in decisions), args.shift_timeout)
        moved = next((d for d in decisions if d.kind == "initial" and d.epoch > 0), None)
        r["seconds_to_new_incumbent"] = round(moved.at - switched, 1) if moved else None
        running.stop()
        after = running.tuner.incumbent
        r["incumbent_after"] = after.key.label()
        r["side_by_side_new_workload"] = side_by_side(args, rig, window, before.policy if before else None,
                                                      after.policy)
    r["decisions"] = [d.as_dict() for d in decisions]
    r["reopened"] = sum(d.kind == "reopen" for d in decisions)
    return r


def exploration_cost(args, rig: Rig, running: _Running) -> dict[str, object]:
    """Output tokens/s exploring vs the incumbent alone, alternating, two pairs."""
    rates: dict[str, list[float]] = {"exploring": [], "alone": []}
    for _ in range(2):
        for mode in ("exploring", "alone"):
            if mode == "exploring":
                running.start()
            tokens, t = rig.output_tokens(), time.monotonic()
            time.sleep(args.steady_seconds)
            rates[mode].append((rig.output_tokens() - tokens) / (time.monotonic() - t))
            if mode == "exploring":
                running.stop()
    ratios = [e / a for e, a in zip(rates["exploring"], rates["alone"], strict=True) if a > 0]
    return {"tokens_per_second": rates, "exploring_over_alone": ratios,
            "cost_percent": [round((1 - x) * 100, 1) for x in ratios]}


def side_by_side(args, rig: Rig, window: WindowSpec, before: DraftPolicy | None, after: DraftPolicy):
    k = rig.admin.model_info().max_draft_length
    policies = {"after": after, "plain": DraftPolicy(draft_length=0), f"ngram k={k}": DraftPolicy(Drafter.NGRAM, k)}
    if before is not None and policy_key(before) != policy_key(after):
        policies["before"] = before
    measurer = Measurer(rig.admin, rig.collector, MeasureConfig(window=window, prune=PruneRule(factor=0),
                                                                objective=Objective.MEASURED, cost=CostModel(0)))
    table = compare(measurer, policies, args.compare_rounds, "bench/shift")
    best = min((c for c in table if c.stats.committed), key=lambda c: c.seconds_per_token)
    return [{"name": c.name, "policy": policy_key(c.policy).label(),
             "seconds_per_token": c.seconds_per_token if c.stats.committed else None,
             "over_best": c.seconds_per_token / best.seconds_per_token if c.stats.committed else None}
            for c in table]


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def markdown(result: dict) -> str:
    s, n = result["shift"], result["no-shift"]
    lines = ["| run | incumbent before | after | s to re-open | s to new incumbent | re-opened searches |",
             "|---|---|---|---|---|---|",
             f"| shift | {s['incumbent_before']} | {s.get('incumbent_after')} | {s.get('seconds_to_reopen')} | "
             f"{s.get('seconds_to_new_incumbent')} | {s['reopened']} |",
             f"| no shift | {n['incumbent_before']} | - | - | - | {n['reopened']} |", ""]
    if s.get("side_by_side_new_workload"):
        lines += ["New workload, side by side:", "", "| | policy | ms / token | / best |", "|---|---|---|---|"]
        for row in s["side_by_side_new_workload"]:
            spt = f"{row['seconds_per_token'] * 1e3:.3f}" if row["seconds_per_token"] else "-"
            over = f"{row['over_best']:.3f}" if row["over_best"] else "-"
            lines.append(f"| {row['name']} | {row['policy']} | {spt} | {over} |")
        lines.append("")
    e = n.get("exploration")
    if e:
        lines.append(f"Exploration cost (no-shift run, exploring vs incumbent alone, alternating pairs): "
                     f"{', '.join(f'{x}%' for x in e['cost_percent'])} of output tokens/s")
    return "\n".join(lines) + "\n"
