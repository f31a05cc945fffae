"""What `moespec bench verify-cost` shows and writes: the table of cost(w, U) in ms and plain decode
steps, the fitted model with its held-out error, the summary at a 4- and 5-position window, the profile
JSON and a PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from service.bench.verify_cost.fit import CostModel, HeldOut
from service.bench.verify_cost.geometry import Geometry
from service.bench.verify_cost.measure import PointTiming
from service.bench.verify_cost.profile import FORMAT, MOE_BLOCKS, WHOLE_PASS

# A realistic window overlaps more than uniform routing: on the shipped model, learned routing's 5-position
# unions were 20-25 experts per layer against 31 uniform (from 8 for one position), i.e. ~60% of the
# uniform excess over k. The summary prices that share; it is an assumption, not a measurement of these models.
REALISTIC_EXCESS = 0.6
SUMMARY_WINDOWS = (4, 5)  # "verifying 4 draft tokens": 4 positions, or 5 with the last committed token


def summary(g: Geometry, model: CostModel, plain: float) -> list[dict]:
    rows = []
    for w in SUMMARY_WINDOWS:
        uniform = g.uniform_union(w)
        realistic = g.top_k + REALISTIC_EXCESS * (uniform - g.top_k)
        for label, union in (("uniform", uniform), ("realistic", realistic)):
            seconds = model.seconds(w, union)
            rows.append({"window": w, "overlap": label, "union": round(union, 2), "seconds": seconds,
                         "plain_steps": seconds / plain})
    return rows


def format_table(g: Geometry, timings: Sequence[PointTiming], plain: float, model: CostModel, held: HeldOut,
                 rows: list[dict]) -> str:
    lines = [f"{'w':>3} {'U':>4} {'ms':>9} {'[min, max]':>19} {'steps':>6} {'fit ms':>8}"]
    for t in sorted(timings, key=lambda t: (t.window, t.union)):
        lines.append(f"{t.window:3d} {t.union:4d} {t.median * 1e3:9.3f} [{min(t.seconds) * 1e3:8.3f}, "
                     f"{max(t.seconds) * 1e3:8.3f}] {t.median / plain:6.2f} "
                     f"{model.seconds(t.window, t.union) * 1e3:8.3f}")
    lines.append(f"fit: {model.fixed * 1e3:.4f} ms + {model.per_expert * 1e6:.2f} us x U + "
                 f"{model.per_position * 1e6:.2f} us x w"
                 + (f" + {model.per_expert_position * 1e9:.2f} ns x U x w" if model.per_expert_position else ""))
    lines.append(f"held-out {len(held.points)} (w, U) points: median |error| {held.median_abs:.1%}, "
                 f"max {held.max_abs:.1%}")
    for r in rows:
        lines.append(f"{r['window']}-position verify, {r['overlap']} overlap (U = {r['union']:.1f} of "
                     f"{g.experts}): {r['plain_steps']:.2f} plain decode steps (fitted)")
    return "\n".join(lines)


def profile_json(g: Geometry, device: str, impl: str, math: str, layers: int, threads: int, rounds: int,
                 repeats: int, timings: Sequence[PointTiming], plain: float, model: CostModel, held: HeldOut,
                 rows: list[dict], machine: str, context: int = 0) -> dict:
    return {"format": FORMAT, "device": device, "machine": machine, "impl": impl, "math": math,
            "scope": WHOLE_PASS if context else MOE_BLOCKS, "context": context,
            "geometry": g.to_json(), "layers_benched": layers, "threads": threads, "rounds": rounds,
            "repeats": repeats, "plain_step_seconds": plain,
            "points": [dict(t.to_json(), plain_steps=t.median / plain) for t in timings],
            "model": model.to_json(),
            "held_out": {"points": [list(p) for p in held.points], "relative_errors": list(held.relative_errors),
                         "median_abs": held.median_abs, "max_abs": held.max_abs},
            "summary": rows}


def plot(g: Geometry, timings: Sequence[PointTiming], plain: float, model: CostModel, path: Path) -> None:
    """Cost in plain decode steps against the union, one line per window size, the fit dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    windows = sorted({t.window for t in timings})
    cmap = plt.get_cmap("viridis")
    for i, w in enumerate(windows):
        pts = sorted((t for t in timings if t.window == w), key=lambda t: t.union)
        color = cmap(i / max(1, len(windows) - 1))
        ax.plot([t.union for t in pts], [t.median / plain for t in pts], "o-", color=color, label=f"w={w}", ms=3)
        ax.plot([t.union for t in pts], [model.seconds(w, t.union) / plain for t in pts], "--", color=color, lw=0.8)
    ax.set_xlabel("distinct routed experts per layer (U)")
    ax.set_ylabel("verify cost (plain decode steps)")
    ax.set_title(f"{g.name}: verify cost by window and union (dashed: fit)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
