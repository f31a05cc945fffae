"""`moespec bench tuner --scenario shift`: the continuous tuner under a workload shift, a no-shift
control, and what its exploration costs.

Two runs, each on a fresh server, the continuous tuner (tuner/loop/continuous.py) in a thread:
- shift: the load serves the code prompts; once the initial search has decided and the tuner has
  explored for --steady-seconds, the load switches to --shift-prompts (default
  `service/prompts/tables.jsonl`: literal tables whose rows repeat, where prompt lookup copies long
  spans and the draft model falls behind). Reported: seconds from the switch to the re-opened search
  and to the new incumbent, and the old incumbent, plain decoding and each drafter at the longest
  length each measured against the new incumbent in the same rounds (tuner.measurement.compare.compare_paired).
- no-shift: the same, the load never switches; reported: re-opened searches (should be 0) and
  promotions. Then the exploration cost: --exploration-rounds challenge rounds --exploration-gap
  seconds apart, each against the incumbent alone in the gaps around it, projected onto the CLI's
  schedule (tuner/loop/exploration.py).
Writes shift.json / shift.md to --out and prints the table.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import optuna

from service.types import Drafter, DraftPolicy
from tuner.drivers.progress import ProgressPrinter
from tuner.drivers.rig import Rig, RigSpec, open_rig
from tuner.loop.assemble import TuneSettings, assemble
from tuner.loop.continuous import ContinuousTuner
from tuner.loop.continuous_config import ContinuousConfig
from tuner.loop.decisions import Decision
from tuner.loop.exploration import Round, TokenTrace, round_costs, summarize
from tuner.loop.pruning import PruneRule
from tuner.loop.sampler import InitialDesign
from tuner.loop.space import PolicyKey, policy_key
from tuner.loop.study import open_storage
from tuner.measurement.compare import compare_paired
from tuner.measurement.measure import MeasureConfig, Measurer
from tuner.measurement.window import CostModel, Objective, WindowSpec

SETTLE_SECONDS = 1.0  # after a round: requests still in flight under the challenger's policy finish


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
        r["exploration"], explorer = exploration_cost(
            args, rig, lambda cfg, on_round: ContinuousTuner(root.study, make, cfg, args.trials, None, on_decision,
                                                             on_round=on_round),
            config, running.tuner.incumbent.key if running.tuner.incumbent else None)  # it may have moved since
        r["incumbent_after"] = explorer.incumbent.key.label()
    else:
        time.sleep(args.steady_seconds)
        seen = len(decisions)
        # What the shift leaves behind: the incumbent now (the steady phase may have moved it).
        before = running.tuner.incumbent
        r["incumbent_at_switch"] = before.key.label() if before else None
        rig.switch_prompts(new_prompts, args.shift_temperature)
        switched = time.time()  # Decision.at is wall time
        # The tuner follows a shift by re-opening its search (the shift detector) or by promoting a
        # challenger (plain decoding is one in every rotation): either is a new incumbent.
        def moved_on(d: Decision) -> bool:
            return d.kind == "promote" or (d.kind == "initial" and d.epoch > 0)

        wait_for(lambda: any(d.kind == "reopen" or moved_on(d) for d in decisions[seen:]), args.shift_timeout)
        reopened = next((d for d in decisions[seen:] if d.kind == "reopen"), None)
        r["seconds_to_reopen"] = round(reopened.at - switched, 1) if reopened else None
        wait_for(lambda: any(moved_on(d) for d in decisions[seen:]), args.shift_timeout)
        moved = next((d for d in decisions[seen:] if moved_on(d)), None)
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


def exploration_cost(args, rig: Rig, new_tuner: Callable[..., ContinuousTuner], config: ContinuousConfig,
                     incumbent: PolicyKey | None) -> tuple[dict[str, object], ContinuousTuner]:
    """The continuous tuner's exploration cost (tuner.loop.exploration): it runs --exploration-rounds
    challenge rounds --exploration-gap seconds apart, without restarts, while the load's output
    tokens are sampled; the incumbent serves alone for one gap before the first round and after the
    last. `new_tuner(config, on_round)` builds the tuner on the run's study (it resumes the saved
    incumbent, `incumbent`). Returns the summary and that tuner."""
    gap = args.exploration_gap
    rounds: list[Round] = []
    trace = TokenTrace()
    last = {"key": incumbent}

    def on_round(start: float, end: float, floor: float) -> None:
        key = tuner.incumbent.key if tuner.incumbent else None
        rounds.append(Round(start, end, floor, incumbent_changed=key != last["key"]))
        last["key"] = key

    def sample_until(deadline: float, done=lambda: False) -> None:
        while time.monotonic() < deadline and not done():
            trace.add(time.monotonic(), rig.output_tokens())
            time.sleep(0.2)
        trace.add(time.monotonic(), rig.output_tokens())

    tuner = new_tuner(replace(config, idle_seconds=gap, max_idle_seconds=gap), on_round)
    first = time.monotonic()
    sample_until(first + gap)
    stop = threading.Event()
    thread = threading.Thread(target=tuner.run, args=(stop,), daemon=True, name="continuous-exploration")
    thread.start()
    sample_until(time.monotonic() + args.shift_timeout, lambda: len(rounds) >= args.exploration_rounds)
    stop.set()
    thread.join(600)
    tuner.restore()
    end = (rounds[-1].end if rounds else time.monotonic()) + SETTLE_SECONDS + gap
    sample_until(end)
    costs = round_costs(trace, rounds, first, end, SETTLE_SECONDS)
    summary = summarize(costs, rounds, ContinuousConfig().idle_seconds, ContinuousConfig().max_idle_seconds)
    summary["gap_seconds"] = gap
    for c in costs:
        print(f"bench exploration: round {c.seconds:.1f} s, lost {c.lost_seconds:.2f} s against "
              f"{c.alone_tokens_per_second:.1f} tok/s alone" + ("" if c.used else " (not used)"),
              file=sys.stderr, flush=True)
    return summary, tuner


def side_by_side(args, rig: Rig, window: WindowSpec, before: DraftPolicy | None, after: DraftPolicy):
    """The new incumbent against the old one, plain decoding and each drafter at the longest length,
    every one against the new incumbent in the same round (tuner.measurement.compare.compare_paired; ratios > 1:
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
    lines = ["| run | incumbent after the search | at the switch | after | s to re-open | s to new incumbent | "
             "re-opened searches | promotions |", "|---|---|---|---|---|---|---|---|"]
    if s is not None:
        lines.append(f"| shift | {s['incumbent_before']} | {s.get('incumbent_at_switch', '-')} | "
                     f"{s.get('incumbent_after')} | {s.get('seconds_to_reopen')} | "
                     f"{s.get('seconds_to_new_incumbent')} | {s['reopened']} | {s['promoted']} |")
    if n is not None:
        lines.append(f"| no shift | {n['incumbent_before']} | - | {n.get('incumbent_after')} | - | - | {n['reopened']} "
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
        lines += [f"Exploration cost (no-shift run): {len(e['rounds'])} challenge rounds {e['gap_seconds']} s apart, "
                  "each against the incumbent alone in the gaps around it:", "",
                  "| round | seconds | lost seconds | alone tok/s | used |", "|---|---|---|---|---|"]
        for i, c in enumerate(e["rounds"]):
            lines.append(f"| {i + 1} | {c['seconds']} | {c['lost_seconds']} | {c['alone_tokens_per_second']} "
                         f"| {'yes' if c['used'] else 'no (incumbent changed)'} |")
        if e["used_rounds"]:
            lines += ["", f"Lost per round: median {e['lost_seconds_per_round_median']} s (range "
                      f"{e['lost_seconds_per_round_min']} to {e['lost_seconds_per_round_max']}) of "
                      f"{e['round_seconds_median']} s rounds. Cost of the incumbent's throughput: "
                      f"{e['measured_cost_percent']}% measured at the {e['gap_seconds']}-s gap; "
                      f"{e['steady_cost_percent']}% in the CLI's steady state (a round every "
                      f"{e['steady_spacing_seconds']:.0f} s); {e['first_hour_cost_percent']}% over the first hour "
                      f"after a decision ({e['first_hour_rounds']} rounds while the back-off grows)."]
    return "\n".join(lines) + "\n"
