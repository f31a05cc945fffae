"""`moespec bench tuner --scenario whatif`: the same study with and without the what-if hint.

1. One rig: `moespec serve --record-steps FILE` (embedded model), a span receiver, one closed-loop
   greedy load cycling the first --prompt-count prompts.
2. For each of --seeds: the same TPE study (--trials measured search trials, --remeasure, server
   defaults otherwise) run without the hint and with it (`TuneSettings.whatif_recording` = the
   server's file), in alternating order, on the same server and workload.
3. Per run: its pick; the measured trials and policy switches until that pick was first measured,
   and until the other run's pick was first measured (if it ever was); totals. A policy switch is
   a change of the set of policies the server runs (drafter / length / temperature; a policy-id-only
   change swaps nothing on SGLang, see the tuner's switch cost rule), counted at the admin client.
Writes whatif.json and whatif.md to --out and prints the table. The picks are not measured side by
side: the question is how soon each run gets to a policy, not which policy is better.
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
from tuner.progress import ProgressPrinter
from tuner.rig import RigSpec, open_rig
from tuner.space import PolicyKey, policy_key
from tuner.study import open_storage
from tuner.tuning import EventKind, TunerEvent
from tuner.window import WindowSpec


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
    hints: int = 0

    def on_event(self, e: TunerEvent, switches: int) -> None:
        if e.kind is EventKind.WHATIF and e.message.endswith("enqueued"):
            self.hints += 1
        if e.kind is not EventKind.TRIAL_FINISHED or e.role != "search" or "result reused" in e.message:
            return
        self.trials += 1
        if e.state == "COMPLETE":
            self.at.setdefault(policy_key(e.policy).label(), (self.trials, switches))


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
        for i, seed in enumerate(range(args.seed, args.seed + args.seeds)):
            order = [False, True] if i % 2 == 0 else [True, False]
            for hinted in order:
                name = f"{'whatif' if hinted else 'tpe'}-{seed}"
                admin = SwitchCountingAdmin(rig.client, name)
                seen = FirstMeasured()
                printer = ProgressPrinter(err)

                def on_event(e: TunerEvent, seen=seen, admin=admin, printer=printer) -> None:
                    seen.on_event(e, admin.switches)
                    printer(e)

                print(f"bench whatif: seed {seed}, {'with' if hinted else 'without'} the what-if hint ...",
                      file=err, flush=True)
                settings = TuneSettings(study_name=name, trials=args.trials, tuner_id=f"bench:{name}", seed=seed,
                                        window=window, remeasure_top=args.remeasure,
                                        whatif_recording=recording if hinted else None)
                built = assemble(settings, storage, admin, rig.collector, on_event)
                t0 = time.monotonic()
                pick = built.tuner.run()
                result["runs"].append({
                    "seed": seed, "hint": hinted, "pick": pick.key.label() if pick else None,
                    "seconds": round(time.monotonic() - t0, 1), "measured_trials": seen.trials,
                    "trials_in_study": len(built.study.trials), "switches": admin.switches,
                    "hints_enqueued": seen.hints, "first_measured": seen.at,
                })
    score(result["runs"])
    (out / "whatif.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = markdown(result)
    (out / "whatif.md").write_text(md)
    print(md)
    return 0


def score(runs: list[dict]) -> None:
    """Trials / switches until the run's own pick, and the other run of its seed's pick, first measured."""
    for r in runs:
        other = next(o for o in runs if o["seed"] == r["seed"] and o["hint"] != r["hint"])
        r["to_own_pick"] = r["first_measured"].get(r["pick"])
        r["other_pick"] = other["pick"]
        r["to_other_pick"] = r["first_measured"].get(other["pick"])


def markdown(result: dict) -> str:
    def at(x) -> str:
        return f"{x[0]} / {x[1]}" if x else "never"

    lines = ["| seed | hint | pick | trials / switches to it | other run's pick | trials / switches to it | "
             "measured trials | switches | hints queued | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['seed']} | {'yes' if r['hint'] else 'no'} | {r['pick']} | {at(r['to_own_pick'])} | "
                     f"{r['other_pick']} | {at(r['to_other_pick'])} | {r['measured_trials']} | {r['switches']} | "
                     f"{r['hints_enqueued']} | {r['seconds']} |")
    return "\n".join(lines) + "\n"
