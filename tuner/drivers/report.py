"""The demo's report folder: PNG plots, report.json and report.md, from a finished study.

Plots (matplotlib's object API with the Agg canvas: no pyplot state, no display needed):
- history.png: every trial's value (pruned ones at their last running value), best so far;
- cost_vs_length.png: seconds per committed token against draft length, one series per drafter and,
  for the model drafter, per draft-temperature band;
- experts_vs_length.png: per-layer mean unique routed experts per verify pass against draft length,
  beside the uniform-routing expectation E*(1-(1-m/E)^(k+1));
- comparison.png: the side-by-side measurement (best vs plain vs default), per round.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import optuna
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from optuna.trial import FrozenTrial, TrialState

from service.security.redact import redact_url
from service.types import Drafter, ModelInfo
from tuner.loop.space import SearchSpace, policy_key
from tuner.loop.study import PolicyScore, role
from tuner.measurement.compare import Compared
from tuner.measurement.paired import PairedRatio

TEMPERATURE_BANDS = ((0.0, 0.5), (0.5, 1.0), (1.0, math.inf))


@dataclass(frozen=True)
class TrialRow:
    number: int
    state: str
    role: str
    label: str
    drafter: str  # "plain" | "model" | "ngram"
    draft_length: int
    draft_temperature: float | None
    value: float | None  # COMPLETE: the value; PRUNED: the last running value
    attrs: dict
    tree_width: int = 1  # 1 = a chain


def trial_rows(study: optuna.Study, space: SearchSpace) -> list[TrialRow]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state in (TrialState.RUNNING, TrialState.WAITING):
            continue
        key = policy_key(space.policy_from_params(t.params, ""))
        rows.append(TrialRow(t.number, t.state.name, role(t), key.label(), key.drafter, key.draft_length,
                             key.draft_temperature, _value(t), dict(t.user_attrs), key.tree_width))
    return rows


def _value(t: FrozenTrial) -> float | None:
    if t.state is TrialState.COMPLETE:
        return t.value
    if t.state is TrialState.PRUNED and t.intermediate_values:
        return t.intermediate_values[max(t.intermediate_values)]
    return None


def band_label(t: float) -> str:
    lo, hi = next(b for b in TEMPERATURE_BANDS if b[0] <= t < b[1])
    return f"model T in [{lo:g}, {hi:g})" if hi != math.inf else f"model T >= {lo:g}"


def series_of(row: TrialRow) -> str:
    if row.drafter == "model" and row.tree_width > 1:  # a tree's cost at a node budget is not a chain's
        return f"model tree width {row.tree_width}"
    if row.drafter == "model":
        return band_label(row.draft_temperature if row.draft_temperature is not None else 1.0)
    return row.drafter


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_history(rows: Sequence[TrialRow], path: Path, unit: str, scale: float) -> None:
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    groups = {"COMPLETE search": ("o", "tab:blue"), "COMPLETE remeasure": ("D", "tab:orange"),
              "PRUNED (running value)": ("x", "tab:red")}
    for name, (marker, color) in groups.items():
        pts = [(r.number, r.value * scale) for r in rows if r.value is not None and _group(r) == name]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, color=color, label=name, zorder=3)
    failed = [r.number for r in rows if r.state == "FAIL"]
    if failed:
        ax.scatter(failed, [0] * len(failed), marker="|", color="grey", s=200, label="FAIL (no value)")
    best, line = math.inf, []
    for r in sorted(rows, key=lambda r: r.number):
        if r.state == "COMPLETE" and r.value is not None:
            best = min(best, r.value * scale)
        if best < math.inf:
            line.append((r.number, best))
    if line:
        ax.step(*zip(*line, strict=True), where="post", color="black", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(unit)
    ax.set_title("Optimisation history")
    ax.legend(fontsize=8)
    _save(fig, path)


def _group(r: TrialRow) -> str:
    if r.state == "PRUNED":
        return "PRUNED (running value)"
    return f"COMPLETE {r.role}" if r.state == "COMPLETE" else ""


def plot_cost_vs_length(rows: Sequence[TrialRow], path: Path, unit: str, scale: float) -> None:
    """Complete trials as dots with a mean line per series; pruned ones as crosses at their running
    value (so a drafter the tuner kept pruning still shows where it stood)."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    done: dict[str, list[tuple[int, float]]] = defaultdict(list)
    pruned: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r.value is not None and "duplicate_of" not in r.attrs:
            (done if r.state == "COMPLETE" else pruned)[series_of(r)].append((r.draft_length, r.value * scale))
    plain = done.pop("plain", []) + pruned.pop("plain", [])
    colors = iter(["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"])
    order = [band_label(lo) for lo, _ in TEMPERATURE_BANDS] + ["ngram"]
    for name in sorted(set(done) | set(pruned), key=lambda n: order.index(n) if n in order else len(order)):
        color = next(colors, "tab:gray")
        if done[name]:
            ax.scatter(*zip(*done[name], strict=True), alpha=0.5, s=18, color=color)
            ax.plot(*zip(*_means(done[name]), strict=True), color=color, label=name, marker="o")
        if pruned[name]:
            ax.scatter(*zip(*pruned[name], strict=True), marker="x", color=color,
                       label=f"{name} (pruned, running value)")
    if plain:
        ax.axhline(sum(v for _, v in plain) / len(plain), color="black", ls="--", label="plain decoding (k=0)")
        ax.scatter(*zip(*plain, strict=True), color="black", s=18)
    ax.set_xlabel("draft length k")
    ax.set_ylabel(unit)
    ax.set_title("Cost per committed token vs draft length")
    ax.legend(fontsize=7)
    _save(fig, path)


def _means(pts: list[tuple[int, float]]) -> list[tuple[int, float]]:
    by: dict[int, list[float]] = defaultdict(list)
    for x, y in pts:
        by[x].append(y)
    return sorted((x, sum(v) / len(v)) for x, v in by.items())


def uniform_union(num_experts: int, top_k: int, window: int) -> float:
    return num_experts * (1 - (1 - top_k / num_experts) ** window)


def plot_experts_vs_length(rows: Sequence[TrialRow], info: ModelInfo, path: Path) -> None:
    drafters = [d.value for d in info.drafters]
    fig = Figure(figsize=(5 * len(drafters), 4))
    axes = [fig.add_subplot(1, len(drafters), i + 1) for i in range(len(drafters))]
    plain = [r for r in rows if r.drafter == "plain" and r.attrs.get("unique_experts_mean")]
    ks = range(0, info.max_draft_length + 1)
    for ax, drafter in zip(axes, drafters, strict=True):
        by_len: dict[int, list[list[float]]] = defaultdict(list)
        for r in [*plain, *(r for r in rows if r.drafter == drafter)]:
            if r.state in ("COMPLETE", "PRUNED") and r.attrs.get("unique_experts_mean"):
                by_len[r.draft_length].append(r.attrs["unique_experts_mean"])
        for layer in range(info.num_layers):
            pts = sorted((k, sum(v[layer] for v in vs) / len(vs)) for k, vs in by_len.items())
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"layer {layer}")
        ax.plot(list(ks), [uniform_union(info.num_experts, info.top_k, k + 1) for k in ks], ls=":", color="grey",
                label="uniform routing, k+1 positions")
        ax.set_title(f"{drafter} drafter")
        ax.set_xlabel("draft length k")
        ax.set_ylabel("unique routed experts per verify pass")
        ax.legend(fontsize=7)
    _save(fig, path)


def plot_comparison(compared: Sequence[Compared], path: Path, unit: str, scale: float) -> None:
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    names = [f"{c.name}\n{policy_key(c.policy).label()}" for c in compared]
    values = [c.seconds_per_token * scale if c.stats.committed else 0 for c in compared]
    ax.bar(names, values, color=["tab:green", "tab:grey", "tab:blue", "tab:purple"][: len(compared)])
    for i, c in enumerate(compared):
        pts = [v * scale for v in c.per_round if v != math.inf]
        ax.scatter([i] * len(pts), pts, color="black", s=12, zorder=3)
    ax.set_ylabel(unit)
    ax.set_title("Side by side on the same workload (dots: rounds)")
    _save(fig, path)


def write_plots(rows: Sequence[TrialRow], compared: Sequence[Compared], info: ModelInfo, out: Path) -> list[str]:
    unit, scale = "ms per committed token", 1e3
    plot_history(rows, out / "history.png", unit, scale)
    plot_cost_vs_length(rows, out / "cost_vs_length.png", unit, scale)
    plot_experts_vs_length(rows, info, out / "experts_vs_length.png")
    files = ["history.png", "cost_vs_length.png", "experts_vs_length.png"]
    if compared:
        plot_comparison(compared, out / "comparison.png", unit, scale)
        files.append("comparison.png")
    return files


def decode_step(plain: Compared | None, info: ModelInfo) -> float:
    """The plain decode step measured side by side with the others (same load, same moment); the
    engine's own calibration runs once at startup and is off whenever the CPU was busy then."""
    if plain is not None and plain.stats.steps:
        return plain.stats.verify_seconds / plain.stats.steps
    return info.decode_step_seconds


def why(best: Compared, plain: Compared | None, decode_step_seconds: float) -> str:
    """One paragraph: what the winner does per step, in decode-step units, against plain decoding."""
    s = best.stats
    if not s.steps or not s.committed:
        return "The winner's final window committed no tokens."
    dse = s.decode_step_equivalents(decode_step_seconds)
    per_token = dse * s.steps / s.committed
    layers = ", ".join(f"{x:.1f}" for x in s.unique_experts_mean)
    if best.policy.draft_length == 0:
        text = (f"Plain decoding wins: no draft/verify combination committed tokens more cheaply. Each step "
                f"touches {layers} unique experts per layer.")
    else:
        draft_ms = s.draft_seconds / s.steps * 1e3
        text = (f"{policy_key(best.policy).label()}: {s.acceptance_rate:.0%} of drafted tokens accepted, "
                f"{s.committed / s.steps:.2f} tokens committed per verify pass; a pass touches {layers} unique "
                f"experts per layer and costs {dse:.2f} plain decode steps, plus {draft_ms:.2f} ms of drafting, "
                f"so a committed token costs ~{per_token:.2f} decode steps of verification")
        text += " (plus the drafting)." if best.policy.drafter is Drafter.MODEL else " (n-gram drafting is free)."
    if plain is not None and plain.stats.committed and best is not plain:
        gain = plain.seconds_per_token / best.seconds_per_token
        text += f" Measured against plain decoding: {gain:.2f}x the token rate."
    return text


def write_report(
    out: Path,
    *,
    study: optuna.Study,
    space: SearchSpace,
    info: ModelInfo,
    winner: PolicyScore | None,
    compared: Sequence[Compared],
    storage_url: str,
    dashboard: str,
    extra: dict[str, object],
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rows = trial_rows(study, space)
    plots = write_plots(rows, compared, info, out)
    by_name = {c.name: c for c in compared}
    best = by_name.get("best")
    step = decode_step(by_name.get("plain"), info)
    explanation = why(best, by_name.get("plain"), step) if best else ""
    states = defaultdict(int)
    for r in rows:
        states[r.state] += 1
    data = {
        "study": study.study_name,
        "storage": redact_url(storage_url),
        "open_dashboard": dashboard,
        "model_info": study.user_attrs.get("model_info"),
        "sampler": study.user_attrs.get("sampler"),
        "sampler_why": study.user_attrs.get("sampler_why"),
        "winner": study.user_attrs.get("winner"),
        "comparison": [c.as_dict(step) for c in compared],
        "decode_step_seconds": {"measured_plain": step, "engine_calibration": info.decode_step_seconds},
        "why": explanation,
        "trial_states": dict(states),
        "trials": [{"number": r.number, "state": r.state, "role": r.role, "policy": r.label,
                    "value": r.value, **{k: r.attrs.get(k) for k in (
                        "acceptance_rate", "mean_accepted_per_step", "unique_experts_mean", "widest_layer",
                        "decode_step_equivalents", "modelled_bytes_per_token", "requests", "committed_tokens",
                        "fail_reason", "prune_reason", "trial_mode", "control_policy", "paired_ratio",
                        "paired_ratio_low", "paired_ratio_high", "candidate_share", "duplicate_of")}} for r in rows],
        "trial_mode": study.user_attrs.get("trial_mode"),
        "side_by_side_ratios": side_by_side_ratios(compared),
        "plots": plots,
        **extra,
    }
    (out / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (out / "report.md").write_text(_markdown(data, compared, winner, step, explanation, plots))
    return out


def side_by_side_ratios(compared: Sequence[Compared]) -> list[dict[str, object]]:
    """Each policy's cost relative to the best one over the comparison rounds, with the 95% interval
    from their per-request costs (tuner.measurement.paired)."""
    best = next((c for c in compared if c.name == "best"), None)
    if best is None or not best.stats.committed:
        return []
    out = []
    for c in compared:
        if c is best or not c.stats.committed:
            continue
        r = PairedRatio.of(c.stats, best.stats)
        out.append({"name": c.name, "policy": policy_key(c.policy).label(), **r.as_attrs()})
    return out


def _fmt_ratio(ratio, low, high) -> str:
    if ratio is None:
        return "-"
    interval = f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else " [-, -]"
    return f"{ratio:.3f}x{interval}"


def _markdown(data: dict, compared: Sequence[Compared], winner: PolicyScore | None, step: float,
              explanation: str, plots: list[str]) -> str:
    lines = [f"# moespec tuning report: study `{data['study']}`", ""]
    if winner:
        vals = ", ".join(f"{v * 1e3:.3f}" for v in winner.values)
        lines += [f"**Winner: {winner.key.label()}** (policy id `{winner.policy.policy_id}`), "
                  f"{winner.mean * 1e3:.3f} ms per committed token, mean of [{vals}] ms over its measurements.", ""]
    if explanation:
        lines += [explanation, ""]
    if compared:
        plain = next((c for c in compared if c.name == "plain"), None)
        lines += ["## Side by side (same workload, interleaved rounds)", "",
                  "| | policy | ms / committed token | vs plain | acceptance | committed / step | "
                  "verify pass (decode steps) | unique experts / layer | tokens |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in compared:
            d = c.as_dict(step)
            spt = d["seconds_per_token"]
            rel = (f"{plain.seconds_per_token / c.seconds_per_token:.2f}x"
                   if plain and spt and plain.stats.committed else "-")
            lines.append(
                f"| {c.name} | {d['policy']} | {spt * 1e3:.3f} | {rel} | {d['acceptance_rate']:.2f} | "
                f"{d['committed_per_step']:.2f} | {d['decode_step_equivalents']:.2f} | "
                f"{', '.join(f'{x:.1f}' for x in d['unique_experts_mean'])} | {d['committed_tokens']} |"
                if spt else f"| {c.name} | {d['policy']} | no tokens | - | - | - | - | - | 0 |")
        lines.append("")
        if data["side_by_side_ratios"]:
            lines += ["Cost relative to the best policy over the same rounds, with the 95% interval from the "
                      "per-request costs (>1: the best policy is cheaper):", "",
                      "| | policy | cost / best's [95% interval] |", "|---|---|---|"]
            for r in data["side_by_side_ratios"]:
                lines.append(f"| {r['name']} | {r['policy']} | "
                             f"{_fmt_ratio(r['paired_ratio'], r['paired_ratio_low'], r['paired_ratio_high'])} |")
            lines.append("")
    paired = [t for t in data["trials"] if t.get("paired_ratio") is not None]
    if paired:
        interleaved = data["trial_mode"] == "interleaved"
        how = ("between control windows of the incumbent just before and after it (each window one policy, so "
               "requests that share passes never mix policies)" if interleaved else
               "beside a control (the incumbent) in the same window, in one traffic split")
        lines += ["## Paired trials", "",
                  f"Trial mode `{data['trial_mode']}`: each candidate ran {how}; its value is the candidate/control "
                  "cost ratio times the control's value, so a machine that slows down slows both arms and leaves "
                  "the value alone.", "",
                  "| # | role | state | candidate | control | share | candidate / control [95% interval] |",
                  "|---|---|---|---|---|---|---|"]
        for t in paired:
            split = not interleaved and t.get("candidate_share") is not None
            share = f"{t['candidate_share']:.2f}" if split else "-"
            lines.append(f"| {t['number']} | {t['role']} | {t['state']} | {t['policy']} | {t['control_policy']} | "
                         f"{share} | "
                         f"{_fmt_ratio(t['paired_ratio'], t['paired_ratio_low'], t['paired_ratio_high'])} |")
        lines.append("")
    lines += ["## Trials", "", f"States: {dict(data['trial_states'])}. Sampler: {data['sampler_why']} "
              "(details in `tuner/loop/sampler.py`).", "",
              "| # | role | state | policy | ms / token | acceptance | unique experts / layer | note |",
              "|---|---|---|---|---|---|---|---|"]
    for t in data["trials"]:
        value = f"{t['value'] * 1e3:.3f}" if t["value"] is not None else "-"
        acc = f"{t['acceptance_rate']:.2f}" if t.get("acceptance_rate") is not None else "-"
        ue = ", ".join(f"{x:.1f}" for x in t.get("unique_experts_mean") or [])
        note = (t.get("prune_reason") or t.get("fail_reason") or "").replace("|", "/")
        if t.get("duplicate_of") is not None:
            note = f"re-proposal of trial {t['duplicate_of']}: result reused, not counted"
        lines.append(f"| {t['number']} | {t['role']} | {t['state']} | {t['policy']} | {value} | {acc} | {ue} | "
                     f"{note} |")
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Open the study", "", "```", data["open_dashboard"], "```", ""]
    return "\n".join(lines)
