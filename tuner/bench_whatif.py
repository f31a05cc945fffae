"""`moespec bench tuner --scenario whatif`: how many trials / policy switches the what-if hint saves
to reach the same pick.

1. One rig: `moespec serve --record-steps FILE` (embedded model), a span receiver, one closed-loop
   greedy load cycling the first --prompt-count prompts.
2. The reference: every draft length of each drafter (model drafter at temperature 0) and plain
   decoding, measured side by side in --compare-rounds interleaved rounds through the trial window.
   Its best policy is the reference pick; the policies within 5% of it are the target ("a pick
   within a tolerance of it"). A model-drafter trial matches a reference point of its length when
   its temperature is at most 0.1 (the reference measured T = 0 only).
3. For each of --seeds and each start (with the baselines the tuner enqueues first, and without
   them: TPE's own random start, where the baselines do not sit near the answer): the same TPE
   study (--trials measured search trials, --remeasure, server defaults otherwise) run without the
   hint and with it (`TuneSettings.whatif_recording` = the server's file), in alternating order.
4. Per run: measured search trials and policy switches until a trial of the reference pick, and of
   any target policy, first completed ("never" within the budget otherwise); its own pick. A policy
   switch is a change of the set of policies the server runs (drafter / length / temperature; a
   policy-id-only change swaps nothing on SGLang, see the tuner's switch cost rule), counted at the
   admin client. Per start: the paired difference (without - with) over the seeds, mean and min-max.
Writes whatif.json and whatif.md to --out and prints the tables.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import optuna

from service.traffic import TrafficSplit
from service.types import DraftPolicy
from tuner.admin import PolicyAdmin
from tuner.assemble import TuneSettings, assemble
from tuner.compare import compare
from tuner.measure import MeasureConfig, Measurer
from tuner.progress import ProgressPrinter
from tuner.pruning import PruneRule
from tuner.rig import Rig, RigSpec, open_rig
from tuner.space import PolicyKey, policy_key
from tuner.study import open_storage
from tuner.tuning import EventKind, TunerEvent
from tuner.window import CostModel, Objective, WindowSpec

WITHIN = 1.05  # target: reference cost within 5% of the reference pick's
TEMPERATURE_MATCH = 0.1  # a model-drafter trial at T <= this matches the reference's T = 0 point


class SwitchCountingAdmin(PolicyAdmin):
    """PolicyAdmin that counts policy switches: changes of the set of policies the server runs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.switches = 0
        self._running: frozenset[PolicyKey] | None = None

    def _served(self, keys: frozenset[PolicyKey]) -> None:
        if keys != self._running:
            self.switches += 1
            self._running = keys

    def apply(self, policy: DraftPolicy) -> DraftPolicy:
        applied = super().apply(policy)
        self._served(frozenset({policy_key(policy)}))
        return applied

    def apply_split(self, split: TrafficSplit) -> TrafficSplit:
        applied = super().apply_split(split)
        self._served(frozenset(policy_key(a.policy) for a in split.arms if a.weight > 0))
        return applied


@dataclass
class FirstMeasured:
    """Per policy: measured search trials and switches when a trial of it first finished measured."""

    trials: int = 0
    at: dict[str, tuple[int, int]] = field(default_factory=dict)  # label -> (measured trials, switches)
    keys: dict[str, PolicyKey] = field(default_factory=dict)  # label -> its key
    hints: int = 0
    hinted: set[str] = field(default_factory=set)  # labels a hint enqueued
    from_hint: dict[str, bool] = field(default_factory=dict)  # label -> its first trial was a hint's

    def on_event(self, e: TunerEvent, switches: int) -> None:
        if e.kind is EventKind.WHATIF and e.message.endswith("enqueued"):
            self.hints += 1
            self.hinted.add(policy_key(e.policy).label())
        if e.kind is not EventKind.TRIAL_FINISHED or e.role != "search" or "result reused" in e.message:
            return
        self.trials += 1
        if e.state == "COMPLETE":
            key = policy_key(e.policy)
            self.at.setdefault(key.label(), (self.trials, switches))
            self.keys.setdefault(key.label(), key)
            self.from_hint.setdefault(key.label(), key.label() in self.hinted)

    def first_of(self, targets: set[PolicyKey]) -> tuple[int, int] | None:
        """(trials, switches) when a trial matching any of `targets` first completed."""
        hit = self._first_label(targets)
        return self.at[hit] if hit is not None else None

    def first_from_hint(self, targets: set[PolicyKey]) -> bool | None:
        """Whether that first trial was one a what-if hint enqueued (None: never reached)."""
        hit = self._first_label(targets)
        return self.from_hint[hit] if hit is not None else None

    def _first_label(self, targets: set[PolicyKey]) -> str | None:
        hits = [label for label, key in self.keys.items() if any(matches(key, t) for t in targets)]
        return min(hits, key=self.at.__getitem__) if hits else None


def matches(key: PolicyKey, reference: PolicyKey) -> bool:
    """A measured policy is a reference point: same drafter and length; model drafter at T <= 0.1."""
    if (key.drafter, key.draft_length) != (reference.drafter, reference.draft_length):
        return False
    return key.draft_temperature is None or key.draft_temperature <= TEMPERATURE_MATCH


def reference_sweep(args, rig: Rig, window: WindowSpec) -> dict[str, object]:
    """Every length of each drafter (model at T = 0) and plain, side by side: the reference pick and target."""
    info = rig.admin.model_info()
    policies = {"plain": DraftPolicy(draft_length=0)}
    for drafter in info.drafters:
        for k in range(1, info.max_draft_length + 1):
            policy = DraftPolicy(drafter, k, 0.0)
            policies[policy_key(policy).label()] = policy
    measurer = Measurer(rig.admin, rig.collector, MeasureConfig(window=window, prune=PruneRule(factor=0),
                                                                objective=Objective.MEASURED, cost=CostModel(0)))
    print(f"bench whatif: reference, {len(policies)} policies side by side, {args.compare_rounds} rounds ...",
          file=sys.stderr, flush=True)
    table = compare(measurer, policies, args.compare_rounds, "bench/whatif-reference")
    cost = {c.name: c.seconds_per_token for c in table if c.stats.committed}
    best = min(cost, key=cost.get)
    target = sorted((n for n in cost if cost[n] <= WITHIN * cost[best]), key=cost.get)
    return {"pick": best, "target": target, "seconds_per_token": cost,
            "per_round": {c.name: [x if x != float("inf") else None for x in c.per_round] for c in table},
            "keys": {c.name: policy_key(c.policy) for c in table}}


def run_whatif(args, prompts: list[str], out: Path) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    err = sys.stderr
    storage = open_storage(f"sqlite:///{(out / 'whatif.db').resolve()}")
    recording = (out / "steps.jsonl").resolve()
    window = WindowSpec(args.min_tokens, args.min_steps, args.max_window_seconds)
    result: dict[str, object] = {"settings": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")},
                                 "recording": str(recording), "runs": []}
    spec = RigSpec(prompts, args.concurrency, args.max_new_tokens, args.temperature, args.seed, args.threads,
                   record_steps=recording)
    with open_rig(spec) as rig:
        reference = reference_sweep(args, rig, window)
        keys = reference.pop("keys")
        pick, target = {keys[reference["pick"]]}, {keys[n] for n in reference["target"]}
        for baselines in (True, False):
            for i, seed in enumerate(range(args.seed, args.seed + args.seeds)):
                order = [False, True] if i % 2 == 0 else [True, False]
                for hinted in order:
                    name = f"{'whatif' if hinted else 'tpe'}-{seed}{'' if baselines else '-nobase'}"
                    admin = SwitchCountingAdmin(rig.client, name)
                    seen = FirstMeasured()
                    printer = ProgressPrinter(err)

                    def on_event(e: TunerEvent, seen=seen, admin=admin, printer=printer) -> None:
                        seen.on_event(e, admin.switches)
                        printer(e)

                    print(f"bench whatif: seed {seed}, {'with' if baselines else 'without'} baselines, "
                          f"{'with' if hinted else 'without'} the what-if hint ...", file=err, flush=True)
                    settings = TuneSettings(study_name=name, trials=args.trials, tuner_id=f"bench:{name}",
                                            seed=seed, window=window, remeasure_top=args.remeasure,
                                            enqueue_baselines=baselines,
                                            whatif_recording=recording if hinted else None)
                    built = assemble(settings, storage, admin, rig.collector, on_event)
                    t0 = time.monotonic()
                    chosen = built.tuner.run()
                    result["runs"].append({
                        "seed": seed, "baselines": baselines, "hint": hinted,
                        "pick": chosen.key.label() if chosen else None,
                        "seconds": round(time.monotonic() - t0, 1), "measured_trials": seen.trials,
                        "trials_in_study": len(built.study.trials), "switches": admin.switches,
                        "hints_enqueued": seen.hints, "first_measured": seen.at,
                        "to_reference_pick": seen.first_of(pick), "to_target": seen.first_of(target),
                        "target_from_hint": seen.first_from_hint(target),
                    })
    result["reference"] = reference
    result["summary"] = summarise(result["runs"], args.trials)
    (out / "whatif.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = markdown(result)
    (out / "whatif.md").write_text(md)
    print(md)
    return 0


def summarise(runs: list[dict], budget: int) -> list[dict]:
    """Per start and goal: trials / switches to it without and with the hint over the seeds (a run
    that never got there: budget + 1 trials, a lower bound, and no switch count; how many never did
    is reported), and the paired saving (without - with) over the seeds where both got there."""
    out = []
    for baselines in (True, False):
        for goal in ("to_reference_pick", "to_target"):
            rows = {(r["seed"], r["hint"]): r[goal] for r in runs if r["baselines"] == baselines}
            seeds = sorted({seed for seed, _ in rows})
            if not seeds:
                continue
            entry = {"baselines": baselines, "goal": goal}
            for hint in (False, True):
                name = "with" if hint else "without"
                reached = [rows[(s, hint)] for s in seeds]
                entry[f"{name}_never"] = sum(x is None for x in reached)
                entry[f"{name}_trials"] = [x[0] if x else budget + 1 for x in reached]
                entry[f"{name}_switches"] = [x[1] if x else None for x in reached]
            both = [s for s in seeds if rows[(s, False)] and rows[(s, True)]]
            entry["saved_trials"] = [rows[(s, False)][0] - rows[(s, True)][0] for s in both]
            entry["saved_switches"] = [rows[(s, False)][1] - rows[(s, True)][1] for s in both]
            out.append(entry)
    return out


def _at(x) -> str:
    return f"{x[0]} / {x[1]}" if x else "never"


def _spread(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{sum(values) / len(values):+.1f} ({min(values):+d}..{max(values):+d})"


def markdown(result: dict) -> str:
    ref = result["reference"]
    cost = ref["seconds_per_token"]
    best = cost[ref["pick"]]
    lines = [f"Reference pick: {ref['pick']} ({best * 1e3:.3f} ms/token side by side); within 5% (the target): "
             + ", ".join(f"{n} ({cost[n] / best:.3f})" for n in ref["target"]) + ".", "",
             "| start | seed | hint | trials / switches to the reference pick | to the target | "
             "target trial from a hint | pick | hints queued | switches in all |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        via = {None: "-", True: "yes", False: "no"}[r.get("target_from_hint")]
        lines.append(f"| {'baselines' if r['baselines'] else 'no baselines'} | {r['seed']} | "
                     f"{'yes' if r['hint'] else 'no'} | {_at(r['to_reference_pick'])} | {_at(r['to_target'])} | "
                     f"{via} | {r['pick']} | {r['hints_enqueued']} | {r['switches']} |")
    budget = int(result["settings"]["trials"])
    lines += ["", f"| start | goal | reached (without / with) | trials to it, mean (without / with; never = "
              f"{budget + 1}, a lower bound) | saved trials where both reached, mean (min..max) | saved switches |",
              "|---|---|---|---|---|---|"]
    for e in result["summary"]:
        n = len(e["without_trials"])
        lines.append(f"| {'baselines' if e['baselines'] else 'no baselines'} | "
                     f"{'reference pick' if e['goal'] == 'to_reference_pick' else 'target (within 5%)'} | "
                     f"{n - e['without_never']}/{n} / {n - e['with_never']}/{n} | "
                     f"{sum(e['without_trials']) / n:.1f} / {sum(e['with_trials']) / n:.1f} | "
                     f"{_spread(e['saved_trials'])} (n={len(e['saved_trials'])}) | {_spread(e['saved_switches'])} |")
    return "\n".join(lines) + "\n"
