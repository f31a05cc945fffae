"""`moespec bench tuner --scenario shift`: the continuous tuner under a workload shift, a no-shift
control, and what its exploration costs.

Two runs, each on a fresh server, the continuous tuner (tuner/continuous.py) in a thread:
- shift: the load serves the code prompts; once the initial search has decided and the tuner has
  explored for --steady-seconds, the load switches to --shift-prompts (default
  `service/prompts/tables.jsonl`: literal tables whose rows repeat, where prompt lookup copies long
  spans and the draft model falls behind). Reported: seconds from the switch to the re-opened search
  and to the new incumbent, and the old incumbent, plain decoding and each drafter at the longest
  length each measured against the new incumbent in the same rounds (tuner.compare.compare_paired).
- no-shift: the same, the load never switches; reported: re-opened searches (should be 0) and
  promotions. Exploration cost: output tokens/s with the tuner exploring vs the incumbent alone in
  --exploration-pairs alternating pairs of --steady-seconds periods (see exploration_cost).
Writes shift.json / shift.md to --out and prints the table.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import optuna

from service.types import Drafter, DraftPolicy
from tuner.assemble import TuneSettings, assemble
from tuner.compare import compare_paired
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
    runs = [(label, shift) for label, shift in (("shift", True), ("no-shift", False))
            if not (args.no_shift_only and shift) and not (args.shift_only and not shift)]
    for label, shift in runs:
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
        r["incumbent_after"] = running.tuner.incumbent.key.label()
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
    r["promoted"] = sum(d.kind == "promote" for d in decisions)
    return r


def exploration_cost(args, rig: Rig, running: _Running) -> dict[str, object]:
    """Output tokens/s of the whole load with the tuner exploring vs the incumbent alone, in
    --exploration-pairs pairs of --steady-seconds periods, the order alternating (E A, A E, ...) so a
    linear drift cancels. An exploring period ends when the tuner has stopped (its round in flight
    finished), so it holds whole rounds and their full cost. A pair whose exploring period changed
    the incumbent is discarded: "alone" must run the same incumbent as "exploring" did."""
    pairs: list[dict[str, object]] = []
    for i in range(args.exploration_pairs):
        order = ("exploring", "alone") if i % 2 == 0 else ("alone", "exploring")
        rate: dict[str, float] = {}
        changed = False
        for mode in order:
            before = running.tuner.incumbent.key if running.tuner.incumbent else None
            tokens, t = rig.output_tokens(), time.monotonic()
            if mode == "exploring":
                running.start()
                time.sleep(args.steady_seconds)
                running.stop()
                changed = running.tuner.incumbent is None or running.tuner.incumbent.key != before
            else:
                time.sleep(args.steady_seconds)
            rate[mode] = (rig.output_tokens() - tokens) / (time.monotonic() - t)
        ratio = rate["exploring"] / rate["alone"] if rate["alone"] > 0 else None
        pairs.append({"order": list(order), "tokens_per_second": rate, "exploring_over_alone": ratio,
                      "incumbent_changed": changed, "used": ratio is not None and not changed})
        print(f"bench exploration: pair {i + 1}/{args.exploration_pairs} {order[0]} first: exploring "
              f"{rate['exploring']:.1f} tok/s, alone {rate['alone']:.1f} tok/s"
              + (" (incumbent changed: discarded)" if changed else ""), file=sys.stderr, flush=True)
    used = sorted(p["exploring_over_alone"] for p in pairs if p["used"])
    summary: dict[str, object] = {"pairs": pairs, "used_pairs": len(used)}
    if used:
        costs = [(1 - x) * 100 for x in used]
        summary.update({"cost_percent_median": round(statistics.median(costs), 1),
                        "cost_percent_mean": round(statistics.fmean(costs), 1),
                        "cost_percent_min": round(min(costs), 1), "cost_percent_max": round(max(costs), 1),
                        "cost_percent_sd": round(statistics.stdev(costs), 1) if len(costs) > 1 else None})
    return summary


def side_by_side(args, rig: Rig, window: WindowSpec, before: DraftPolicy | None, after: DraftPolicy):
    """The new incumbent against the old one, plain decoding and each drafter at the longest length,
    every one against the new incumbent in the same round (tuner.compare.compare_paired; ratios > 1:
    the new incumbent is cheaper)."""
    k = rig.admin.model_info().max_draft_length
    policies = {"plain": DraftPolicy(draft_length=0), f"ngram k={k}": DraftPolicy(Drafter.NGRAM, k),
                f"model k={k} T=0": DraftPolicy(Drafter.MODEL, k, 0.0)}
    if before is not None and policy_key(before) != policy_key(after):
        policies["before"] = before
    measurer = Measurer(rig.admin, rig.collector, MeasureConfig(window=window, prune=PruneRule(factor=0),
                                                                objective=Objective.MEASURED, cost=CostModel(0)))
    rows = compare_paired(measurer, after, policies, args.compare_rounds, "bench/shift",
                          shared_passes=rig.admin.model_info().shared_passes)
    return [c.as_dict() for c in rows]


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def markdown(result: dict) -> str:
    s, n = result.get("shift"), result.get("no-shift")
    lines = ["| run | incumbent before | after | s to re-open | s to new incumbent | re-opened searches | promotions |",
             "|---|---|---|---|---|---|---|"]
    if s is not None:
        lines.append(f"| shift | {s['incumbent_before']} | {s.get('incumbent_after')} | {s.get('seconds_to_reopen')} | "
                     f"{s.get('seconds_to_new_incumbent')} | {s['reopened']} | {s['promoted']} |")
    if n is not None:
        lines.append(f"| no shift | {n['incumbent_before']} | {n.get('incumbent_after')} | - | - | {n['reopened']} "
                     f"| {n['promoted']} |")
    lines.append("")
    n = n or {}
    s = s or {}
    if s.get("side_by_side_new_workload"):
        lines += ["New workload: each policy paired with the new incumbent (ratio > 1: the new incumbent is cheaper):",
                  "", "| | policy | cost / new incumbent | 95% interval | per round |", "|---|---|---|---|---|"]
        for row in s["side_by_side_new_workload"]:
            ratio = f"{row['paired_ratio']:.3f}" if row["paired_ratio"] else "-"
            low, high = row["paired_ratio_low"], row["paired_ratio_high"]
            interval = f"{low:.3f}-{high:.3f}" if low is not None and high is not None else "-"
            rounds = ", ".join(f"{x:.3f}" if x else "-" for x in row["per_round"])
            lines.append(f"| {row['name']} | {row['policy']} | {ratio} | {interval} | {rounds} |")
        lines.append("")
    e = n.get("exploration")
    if e:
        lines += ["Exploration cost (no-shift run): output tokens/s with the tuner exploring vs the incumbent alone, "
                  "alternating periods:", "", "| pair | order | exploring tok/s | alone tok/s | cost | used |",
                  "|---|---|---|---|---|---|"]
        for i, p in enumerate(e["pairs"]):
            r = p["tokens_per_second"]
            cost = f"{(1 - p['exploring_over_alone']) * 100:.1f}%" if p["exploring_over_alone"] else "-"
            lines.append(f"| {i + 1} | {' then '.join(p['order'])} | {r['exploring']:.1f} | {r['alone']:.1f} "
                         f"| {cost} | {'yes' if p['used'] else 'no (incumbent changed)'} |")
        if e["used_pairs"]:
            lines += ["", f"Cost over {e['used_pairs']} pairs: median {e['cost_percent_median']}%, mean "
                      f"{e['cost_percent_mean']}%, range {e['cost_percent_min']}% to {e['cost_percent_max']}%"
                      + (f", sd {e['cost_percent_sd']}%" if e.get("cost_percent_sd") is not None else "")]
    return "\n".join(lines) + "\n"
