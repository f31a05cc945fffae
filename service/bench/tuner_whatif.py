"""`moespec bench tuner --scenario whatif`: how many trials / policy switches the what-if hint saves
to reach the same pick.

The hint answers one question, "which draft length for this drafter", so by default (`--space
length`) the study searches exactly that: the draft length 0..max of one drafter (`LengthOnly`; the
model drafter at T = 0, then the n-gram drafter, `--length-drafters`). `--space full` searches the
whole space (plain, every drafter and length, continuous temperature) as `moespec tune` does.

1. One rig: `moespec serve --record-steps FILE` (embedded model), a span receiver, one closed-loop
   greedy load cycling the first --prompt-count prompts.
2. Per searched space, the reference: every policy of it (the model drafter at T = 0) measured in
   windows of its own, --compare-rounds rounds in a rotated order (`tuner.measurement.compare.compare`). Not a
   traffic split: on the batching engine requests in one split share target passes and each is
   charged the whole pass, which biases a split comparison. The cheapest is the reference pick; the
   policies within 5% of it are the target. A model-drafter trial matches a reference point of its
   length when its temperature is at most 0.1 (the reference measured T = 0 only).
3. For each initial design in --starts and each of --seeds: the same TPE study run without the hint
   and with it (`TuneSettings.whatif_recording` = the server's file), in alternating order, server
   defaults otherwise, until a trial of a target policy first completes (the study is stopped there:
   nothing after it changes the count), at most --trials measured search trials (default: the size
   of a length space; TPE's duplicates reuse a result and are not measured, so every length is
   measured at most once). No re-measure phase.
4. Per run: measured search trials and policy switches until then (a policy switch is a change of
   the set of policies the server runs, counted at the admin client); every what-if prediction the
   hinted run made and whether its predicted best length was in the target. Per space and start: the
   paired difference (without - with) over the seeds, and how many seeds the hint saved / cost / tied
   (`service.bench.tuner_whatif_report`, which also writes the tables).
Writes whatif.json and whatif.md to --out and prints the tables.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

import optuna

from service.bench.tuner_whatif_report import markdown, one_position_passes, prediction_errors, summarise
from service.policy.traffic import TrafficSplit
from service.recording import read_recording
from service.types import Drafter, DraftPolicy, ModelInfo
from tuner.drivers.progress import ProgressPrinter
from tuner.drivers.rig import RigSpec, open_rig
from tuner.loop.assemble import TuneSettings, assemble
from tuner.loop.events import EventKind, TunerEvent
from tuner.loop.pruning import PruneRule
from tuner.loop.sampler import InitialDesign
from tuner.loop.space import LengthOnly, PolicyKey, SearchSpace, policy_key
from tuner.loop.study import open_storage
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.compare import compare
from tuner.measurement.measure import MeasureConfig, Measurer
from tuner.measurement.window import CostModel, Objective, WindowSpec

WITHIN = 1.05  # target: reference cost within 5% of the reference pick's
TEMPERATURE_MATCH = 0.1  # a model-drafter trial at T <= this matches the reference's T = 0 point
FULL_SPACE_TRIALS = 14  # --space full's default budget: enough for TPE past the corners, short enough to repeat


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


class TargetReached(Exception):
    """Raised from the study's event callback at its first completed target trial: ends the study
    there (the trial is already told; nothing after it changes what the bench counts)."""


@dataclass(frozen=True)
class Case:
    """One searched space: its name, how the tuner's space is narrowed, the reference's policies and
    the trial budget."""

    name: str
    restrict: LengthOnly | None
    policies: dict[str, DraftPolicy]
    budget: int


def cases(space: str, drafters: list[Drafter], info: ModelInfo, trials: int | None) -> list[Case]:
    """`length`: one case per drafter (plain + every length at T = 0); `full`: plain + every drafter
    and length at T = 0 as the reference of the whole space."""
    plain = {"plain": DraftPolicy(draft_length=0)}

    def lengths(drafter: Drafter) -> dict[str, DraftPolicy]:
        out = {}
        for k in range(1, info.max_draft_length + 1):
            policy = DraftPolicy(drafter, k, 0.0)
            out[policy_key(policy).label()] = policy
        return out

    if space == "full":
        policies = dict(plain)
        for drafter in info.drafters:
            policies.update(lengths(drafter))
        return [Case("full space", None, policies, trials or FULL_SPACE_TRIALS)]
    out = []
    for drafter in drafters:
        restrict = LengthOnly(drafter, 0.0)
        size = info.max_draft_length + 1
        out.append(Case(f"length of {restrict.label()}", restrict, {**plain, **lengths(drafter)},
                        min(trials or size, size)))
    return out


def reference_sweep(measurer: Measurer, policies: dict[str, DraftPolicy], rounds: int, prefix: str,
                    err: TextIO) -> dict[str, object]:
    """Every policy in windows of its own, order rotated per round: the reference pick and target."""
    table = compare(measurer, policies, rounds, prefix,
                    on_measured=lambda n, r, v: print(f"  {n} round {r}: {v * 1e3:.3f} ms/tok", file=err, flush=True))
    cost = {c.name: c.seconds_per_token for c in table if c.stats.committed}
    best = min(cost, key=cost.get)
    target = sorted((n for n in cost if cost[n] <= WITHIN * cost[best]), key=cost.get)
    return {"pick": best, "target": target, "seconds_per_token": cost,
            "per_round": {c.name: [x if x != float("inf") else None for x in c.per_round] for c in table},
            "keys": {c.name: policy_key(c.policy) for c in table}}


def predictions(trials: list[optuna.trial.FrozenTrial], space: SearchSpace, target: set[PolicyKey]) -> list[dict]:
    """Every what-if prediction of a run: the measured policy, the predicted best length k' <= k, and
    whether that length is in the target (a hint was queued / already measured when k' < k)."""
    out = []
    for t in trials:
        if "whatif_best_length" not in t.user_attrs or "duplicate_of" in t.user_attrs:
            continue  # a reused result carries its original's prediction: count it once
        measured = space.policy_from_params(t.params, "")
        best = replace(measured, draft_length=int(t.user_attrs["whatif_best_length"]))
        predicted = {int(k): v for k, v in t.user_attrs.get("whatif_predicted", {}).items()}
        out.append({"trial": t.number, "measured": policy_key(measured).label(),
                    "predicted_best": policy_key(best).label(),
                    "hint": best.draft_length < measured.draft_length,
                    "in_target": any(matches(policy_key(best), k) for k in target),
                    "predicted": {policy_key(replace(measured, draft_length=k)).label(): v
                                  for k, v in sorted(predicted.items())}})
    return out


def run_study(admin: SwitchCountingAdmin, collector: SpanCollector, storage: optuna.storages.BaseStorage,
              settings: TuneSettings, target: set[PolicyKey], err: TextIO) -> dict[str, object]:
    """One study until its first target trial (or the budget); what it took to get there. `admin`
    is fresh for the study (its switch count starts at 0)."""
    seen = FirstMeasured()
    printer = ProgressPrinter(err)

    def on_event(e: TunerEvent) -> None:
        seen.on_event(e, admin.switches)
        printer(e)
        if e.kind is EventKind.TRIAL_FINISHED and seen.first_of(target) is not None:
            raise TargetReached

    built = assemble(settings, storage, admin, collector, on_event)
    t0 = time.monotonic()
    with contextlib.suppress(TargetReached):
        built.tuner.run()
    return {"seconds": round(time.monotonic() - t0, 1), "measured_trials": seen.trials,
            "switches": admin.switches, "hints_enqueued": seen.hints,
            "order": [label for label, _ in sorted(seen.at.items(), key=lambda kv: kv[1])],
            "to_target": seen.first_of(target), "target_from_hint": seen.first_from_hint(target),
            "predictions": predictions(built.study.get_trials(deepcopy=False), built.space, target)}


def run_whatif(args, prompts: list[str], out: Path) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    err = sys.stderr
    db, recording = (out / "whatif.db").resolve(), (out / "steps.jsonl").resolve()
    for scratch in (db, recording):  # a fresh study per name and a recording of this run only
        scratch.unlink(missing_ok=True)
    storage = open_storage(f"sqlite:///{db}")
    window = WindowSpec(args.min_tokens, args.min_steps, args.max_window_seconds)
    result: dict[str, object] = {"settings": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")},
                                 "recording": str(recording), "cases": []}
    spec = RigSpec(prompts, args.concurrency, args.max_new_tokens, args.temperature, args.seed, args.threads,
                   record_steps=recording)
    with open_rig(spec) as rig:
        info = rig.admin.model_info()
        measurer = Measurer(rig.admin, rig.collector, MeasureConfig(
            window=window, prune=PruneRule(factor=0), objective=Objective.MEASURED, cost=CostModel(0)))
        for case in cases(args.space, args.length_drafters, info, args.trials):
            print(f"bench whatif: {case.name}: reference, {len(case.policies)} policies in windows of their own, "
                  f"{args.compare_rounds} rounds ...", file=err, flush=True)
            slug = case.name.replace(" ", "-").replace("=", "")
            reference = reference_sweep(measurer, case.policies, args.compare_rounds, f"bench/{slug}/reference",
                                        err)
            keys = reference.pop("keys")
            target = {keys[n] for n in reference["target"]}
            runs = []
            for start in args.starts:
                for i, seed in enumerate(range(args.seed, args.seed + args.seeds)):
                    for hinted in ([False, True] if i % 2 == 0 else [True, False]):
                        name = f"{slug}-{start}-{'whatif' if hinted else 'tpe'}-{seed}"
                        print(f"bench whatif: {case.name}, start {start}, seed {seed}, "
                              f"{'with' if hinted else 'without'} the what-if hint ...", file=err, flush=True)
                        settings = TuneSettings(study_name=name, trials=case.budget, tuner_id=f"bench:{name}",
                                                seed=seed, window=window, remeasure_top=0,
                                                initial_design=InitialDesign(start), restrict=case.restrict,
                                                whatif_recording=recording if hinted else None)
                        admin = SwitchCountingAdmin(rig.client, name)
                        runs.append({"start": start, "seed": seed, "hint": hinted,
                                     **run_study(admin, rig.collector, storage, settings, target, err)})
            result["cases"].append({"name": case.name, "budget": case.budget, "reference": reference, "runs": runs,
                                    "summary": summarise(runs, case.budget),
                                    "prediction_errors": prediction_errors(runs, reference["seconds_per_token"])})
    result["one_position_passes"] = one_position_passes(read_recording(recording))
    (out / "whatif.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = markdown(result)
    (out / "whatif.md").write_text(md)
    print(md)
    return 0
