"""What `moespec bench tuner --scenario whatif` makes of its runs (`service.bench.tuner_whatif`): the
summaries written to whatif.json and the tables of whatif.md.

Per space and start: trials / switches to the target without and with the hint per seed, the
paired difference (without - with) over the seeds, and how many seeds the hint saved / cost / tied;
the hinted runs' what-if predictions against the reference's own measurements; the recording's
one-position passes (what the replay's k' = 0 anchor is made of).
"""

from __future__ import annotations

import statistics

from service.recording import Recording


def summarise(runs: list[dict], budget: int) -> list[dict]:
    """Per start: trials / switches to the target without and with the hint per seed (never within
    the budget: None, counted as budget + 1 trials in the means, a lower bound), the paired saving
    (without - with) over the seeds where both got there, how many seeds it saved / cost / tied, and
    how many of the hinted runs' predictions named a target length."""
    out = []
    for start in dict.fromkeys(r["start"] for r in runs):
        rows = {(r["seed"], r["hint"]): r for r in runs if r["start"] == start}
        seeds = sorted({seed for seed, _ in rows})
        entry: dict[str, object] = {"start": start, "seeds": seeds}
        for hint in (False, True):
            name = "with" if hint else "without"
            reached = [rows[(s, hint)]["to_target"] for s in seeds]
            entry[f"{name}_never"] = sum(x is None for x in reached)
            entry[f"{name}_trials"] = [x[0] if x else budget + 1 for x in reached]
            entry[f"{name}_switches"] = [x[1] if x else None for x in reached]
        both = [s for s in seeds if rows[(s, False)]["to_target"] and rows[(s, True)]["to_target"]]
        saved = [rows[(s, False)]["to_target"][0] - rows[(s, True)]["to_target"][0] for s in both]
        entry["saved_trials"] = saved
        entry["saved_switches"] = [rows[(s, False)]["to_target"][1] - rows[(s, True)]["to_target"][1] for s in both]
        entry["seeds_saved"] = sum(x > 0 for x in saved)
        entry["seeds_cost"] = sum(x < 0 for x in saved)
        entry["seeds_tied"] = sum(x == 0 for x in saved)
        entry["target_from_hint"] = sum(bool(rows[(s, True)]["target_from_hint"]) for s in seeds)
        made = [p for s in seeds for p in rows[(s, True)]["predictions"]]
        hints = [p for p in made if p["hint"]]
        entry["predictions"] = len(made)
        entry["predictions_in_target"] = sum(p["in_target"] for p in made)
        entry["hints"] = len(hints)
        entry["hints_in_target"] = sum(p["in_target"] for p in hints)
        out.append(entry)
    return out


def prediction_errors(runs: list[dict], reference_cost: dict[str, float]) -> dict[str, list[float]]:
    """Per policy: predicted / reference seconds per token - 1, over every prediction the hinted runs
    made (the replay of one trial against the reference's own windows, measured at another time)."""
    errors: dict[str, list[float]] = {}
    for run in runs:
        for made in run["predictions"]:
            for label, seconds in made.get("predicted", {}).items():
                if label in reference_cost:
                    errors.setdefault(label, []).append(seconds / reference_cost[label] - 1)
    return {label: errors[label] for label in reference_cost if label in errors}


def one_position_passes(recording: Recording) -> dict[str, object]:
    """The one-position passes of a recording, grouped by the recorded policy's drafter and length:
    the what-if replay prices k' = 0 (plain decoding) from a speculative run's own one-position passes
    (its anchor), while plain decoding itself runs only those. Median verify seconds per group,
    beside the header's start-up `decode_step_seconds` (a quiet single-request forward pass)."""
    groups: dict[str, list[float]] = {}
    for step in recording.steps:
        if step.window == 1:
            label = "plain" if step.draft_length == 0 else f"{step.drafter.value} k={step.draft_length}"
            groups.setdefault(label, []).append(step.verify_seconds)
    order = sorted(groups, key=lambda x: (x != "plain", x.split(" ")[0], int(x.split("=")[-1]) if "=" in x else 0))
    return {"startup_decode_step_seconds": recording.header.get("decode_step_seconds"),
            "median_verify_seconds": {g: statistics.median(groups[g]) for g in order},
            "passes": {g: len(groups[g]) for g in order}}


def _at(x) -> str:
    return f"{x[0]} / {x[1]}" if x else "never"


def _spread(values: list) -> str:
    if not values:
        return "-"
    return f"{sum(values) / len(values):+.2f} ({min(values):+d}..{max(values):+d})"


def _ms(x: float | None) -> str:
    return f"{x * 1e3:.2f}" if x is not None else "-"


def markdown(result: dict) -> str:
    lines: list[str] = []
    for case in result["cases"]:
        ref, budget = case["reference"], case["budget"]
        cost, best = ref["seconds_per_token"], ref["seconds_per_token"][ref["pick"]]
        lines += [f"## {case['name']} (budget {budget} measured trials)", "",
                  "Reference, each policy in windows of its own (ms / committed token, pooled; per round):", "",
                  "| policy | ms/token | / pick | per round | in target |", "|---|---:|---:|---|---|"]
        for name in sorted(cost, key=cost.get):
            rounds = ", ".join(_ms(x) for x in ref["per_round"][name])
            lines.append(f"| {name} | {_ms(cost[name])} | {cost[name] / best:.3f} | {rounds} | "
                         f"{'yes' if name in ref['target'] else ''} |")
        lines += ["", "| start | seed | hint | trials / switches to the target | target trial from a hint | "
                  "measured, in order | predictions: measured -> predicted best (in target?) |",
                  "|---|---|---|---|---|---|---|"]
        for r in case["runs"]:
            via = {None: "-", True: "yes", False: "no"}[r["target_from_hint"]]
            preds = "; ".join(f"{p['measured']} -> {p['predicted_best']} ({'yes' if p['in_target'] else 'no'})"
                              for p in r["predictions"]) or "-"
            lines.append(f"| {r['start']} | {r['seed']} | {'yes' if r['hint'] else 'no'} | {_at(r['to_target'])} | "
                         f"{via} | {', '.join(r['order'])} | {preds} |")
        lines += ["", f"| start | reached (without / with) | trials to the target, mean (without / with; never = "
                  f"{budget + 1}) | saved trials (without - with), mean (min..max) | saved switches | seeds "
                  "saved / cost / tied | target trial from a hint | hints in target | predictions in target |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for e in case["summary"]:
            n = len(e["seeds"])
            lines.append(f"| {e['start']} | {n - e['without_never']}/{n} / {n - e['with_never']}/{n} | "
                         f"{sum(e['without_trials']) / n:.2f} / {sum(e['with_trials']) / n:.2f} | "
                         f"{_spread(e['saved_trials'])} (n={len(e['saved_trials'])}) | {_spread(e['saved_switches'])} "
                         f"| {e['seeds_saved']} / {e['seeds_cost']} / {e['seeds_tied']} | {e['target_from_hint']}/{n} "
                         f"| {e['hints_in_target']}/{e['hints']} | {e['predictions_in_target']}/{e['predictions']} |")
        errors = case.get("prediction_errors", {})
        if errors:
            lines += ["", "The hinted runs' what-if predictions against the reference (predicted / reference - 1; "
                      "every replayed trial predicts every length up to its own):", "",
                      "| policy | predictions | median error | min..max |", "|---|---:|---:|---|"]
            for label, errs in errors.items():
                lines.append(f"| {label} | {len(errs)} | {statistics.median(errs):+.1%} | "
                             f"{min(errs):+.1%}..{max(errs):+.1%} |")
        lines.append("")
    lines += one_position_markdown(result.get("one_position_passes"))
    return "\n".join(lines)


def one_position_markdown(passes: dict | None) -> list[str]:
    if not passes or "plain" not in passes["median_verify_seconds"]:
        return []
    medians, plain = passes["median_verify_seconds"], passes["median_verify_seconds"]["plain"]
    startup = passes["startup_decode_step_seconds"]
    lines = ["One-position passes in the recording (the what-if replay's k' = 0 anchor comes from a speculative "
             "run's own), median verify ms and / plain decoding's:", "",
             "| recorded policy | passes | median verify ms | / plain's |", "|---|---:|---:|---:|"]
    for group, seconds in medians.items():
        lines.append(f"| {group} | {passes['passes'][group]} | {_ms(seconds)} | {seconds / plain:.2f} |")
    if startup:
        lines.append(f"| (header: start-up decode step) | - | {_ms(startup)} | {startup / plain:.2f} |")
    return lines + [""]
