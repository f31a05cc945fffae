"""What `moespec whatif` shows of a prediction: the table it prints and the plot it saves."""

from __future__ import annotations

from service.whatif.predict import TREES_SKIPPED_WHY, WhatIf


def format_table(result: WhatIf) -> str:
    ep = result.predictions[0].ep_ranks_touched_mean is not None
    head = ["k'", "accept/pos", "committed/step", "(truncated)", "window", "unique experts / layer",
            "pair overlap mean/min", "verify ms", "draft ms", "ms/token", "(truncated)"]
    if ep:
        head += ["EP ranks / layer", "dispatch B/token"]
    rows = [head]
    for p in result.predictions:
        row = [str(p.draft_length), " ".join(f"{x:.2f}" for x in p.acceptance_per_position) or "-",
               f"{p.committed_per_step:.2f}", f"{p.committed_per_step_truncated:.2f}", f"{p.window_mean:.2f}",
               " / ".join(f"{u:.1f}" for u in p.unique_experts_mean),
               f"{sum(p.pairwise_overlap_mean) / len(p.pairwise_overlap_mean):.1f}/"
               f"{sum(p.pairwise_overlap_min_mean) / len(p.pairwise_overlap_min_mean):.1f}",
               f"{p.verify_seconds_per_step * 1e3:.2f}",
               f"{p.draft_seconds_per_step * 1e3:.2f}", f"{p.seconds_per_committed_token * 1e3:.3f}",
               f"{p.seconds_per_committed_token_truncated * 1e3:.3f}"]
        if ep:
            row += [" / ".join(f"{r:.2f}" for r in p.ep_ranks_touched_mean), f"{p.ep_dispatch_bytes_per_token:.0f}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)) for r in rows]
    c = result.curve
    lines += [
        f"recorded: {result.drafter} k={result.recorded_length} T={result.draft_temperature}, {result.steps} steps "
        f"in {result.requests} requests, measured {result.measured_seconds_per_committed_token * 1e3:.3f} ms/token",
        f"cost curve: verify ms = {c.intercept * 1e3:.3f} + {c.per_position * 1e3:.3f} * window + "
        f"{c.per_expert * 1e3:.4f} * mean union (plain step {c.plain_step_seconds * 1e3:.3f} ms); "
        f"draft ms = {result.draft_curve.per_step * 1e3:.3f} + {result.draft_curve.per_draft * 1e3:.3f} * drafts",
        *([] if (sc := result.speculative_curve) is None else [
            f"windows >= 2 (their own line): verify ms = {sc.intercept * 1e3:.3f} + {sc.per_position * 1e3:.3f} * "
            f"window + {sc.per_expert * 1e3:.4f} * mean union"]),
        *([] if not result.tree_steps_skipped else [
            f"{result.tree_steps_skipped} tree steps skipped: {TREES_SKIPPED_WHY} (the chain steps around them "
            "are replayed as separate runs)"]),
        *([] if result.cost_profile is None else [
            f"verify passes priced by the cost profile: {result.cost_profile} (draft time as recorded)"]),
        f"predicted best draft length: {result.best.draft_length}",
    ]
    return "\n".join(lines)


def plot(result: WhatIf, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [p.draft_length for p in result.predictions]
    fig, (cost, unions) = plt.subplots(1, 2, figsize=(11, 4))
    cost.plot(ks, [p.seconds_per_committed_token * 1e3 for p in result.predictions], "o-", label="replay")
    cost.plot(ks, [p.seconds_per_committed_token_truncated * 1e3 for p in result.predictions], "x--",
              label="truncated steps")
    cost.axhline(result.measured_seconds_per_committed_token * 1e3, color="grey", lw=0.8,
                 label=f"measured at k={result.recorded_length}")
    cost.set(xlabel="draft length k'", ylabel="ms per committed token (predicted)",
             title=f"{result.drafter} drafter, recorded at k={result.recorded_length}")
    cost.legend()
    layers = len(result.predictions[0].unique_experts_mean)
    for layer in range(layers):
        unions.plot(ks, [p.unique_experts_mean[layer] for p in result.predictions], "o-", label=f"layer {layer}")
    unions.set(xlabel="draft length k'", ylabel="unique routed experts per pass", title="per-layer union vs k'")
    unions.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
