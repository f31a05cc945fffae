"""Single-stream plain decoding as a share of the step limit (service/bench/limit.py).

The limit: a plain decode step must read every weight its token touches and do its multiply-adds,
so no engine decodes faster than the step's weight bytes at this machine's cache-resident read rate
(or its flops at the FMA rate, whichever binds). The bytes are counted from the model's shapes at
the panels the fused kernels read (bf16 for the shipped checkpoint); both rates are measured right
before each measurement, on as many threads as the kernels use, so load from anything else on the
machine moves the limit and the speed together. Engines without the fused kernels (the eager step) are held
to the same limit.

Every speed comes twice: by wall time (what a client sees) and by this process's CPU time (time
the kernel did not run us is left out; memory stalls still count). On a machine shared with other
busy processes the wall figures swing with their load and the CPU figures much less.

`bandwidth_share` runs the steps round by round, rotating which goes first, on the same prompts
with greedy sampling (all emit the same tokens), and reports every round, so the spread is visible
next to the medians: the default fast step, the same with eager attention (`EngineConfig.
fused_attention=False`), with float32 products (`math="fp32"`) and the eager step
(`EngineConfig.fast_step=False`). Speed-ups pair the default with each, round by round.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from service.bench.limit import fused_step_cost, measure_rates
from service.types import DraftPolicy, GenerationRequest, SamplingParams

# Which EngineConfig each mode runs; "fast" is the default and the one the others are compared to.
MODES = {"reference": dict(fast_step=False), "eager_attention": dict(fused_attention=False),
         "fp32_math": dict(math="fp32"), "fast": {}}
BASELINES = ("reference", "eager_attention", "fp32_math")


@dataclass
class Round:
    mode: str
    round: int
    tokens: int
    seconds: float  # wall time of the generate calls
    cpu_seconds: float  # this process's CPU time over the same calls
    step_ms_median: float  # plain decode steps alone (StepRecord.verify_seconds, wall)
    read_gbs: float  # the cache-resident read rate measured before this round's mode
    limit_tokens_per_second: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_cpu_second(self) -> float:
        return self.tokens / self.cpu_seconds

    @property
    def share(self) -> float:
        return self.tokens_per_second / self.limit_tokens_per_second

    @property
    def share_cpu(self) -> float:
        return self.tokens_per_cpu_second / self.limit_tokens_per_second


def bandwidth_share(prompts: list[str], max_new: int, rounds: int, threads: int) -> dict:
    from service.engine import Engine, EngineConfig

    engines = {mode: Engine(EngineConfig(threads=threads, **overrides)) for mode, overrides in MODES.items()}
    if engines["fast"].step_kind != "fast":
        raise RuntimeError("the fused kernel did not build here (no C compiler?): nothing to compare")
    fast = engines["fast"]
    cost, bf16_math = fused_step_cost(fast.target, context=len(fast.tokenizer.encode(prompts[0]).ids) + max_new // 2)
    greedy = SamplingParams(temperature=0)
    for engine in engines.values():  # warm-up: first calls pay one-off allocations
        engine.generate(GenerationRequest(prompt=prompts[0], max_new_tokens=8, sampling=greedy), DraftPolicy())
    results: list[Round] = []
    for r in range(rounds):
        order = list(MODES)
        for mode in order[r % len(order):] + order[:r % len(order)]:
            rates = measure_rates(cost.weight_bytes, fast.kernel_threads.threads)
            tokens, seconds, cpu, steps = 0, 0.0, 0.0, []
            for prompt in prompts:
                t0, c0 = time.perf_counter(), time.process_time()
                out = engines[mode].generate(GenerationRequest(prompt=prompt, max_new_tokens=max_new,
                                                               sampling=greedy), DraftPolicy())
                seconds += time.perf_counter() - t0
                cpu += time.process_time() - c0
                tokens += out.completion_tokens
                steps += [s.verify_seconds for s in out.steps]
            results.append(Round(mode, r, tokens, seconds, cpu, 1e3 * statistics.median(steps),
                                 rates.read_bytes_per_second / 1e9, cost.limit_tokens_per_second(rates, bf16_math)))
    return summarize(results, cost.weight_bytes, threads)


def summarize(results: list[Round], active: int, threads: int) -> dict:
    def spread(values: list[float], digits: int = 3) -> dict:
        return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
                "max": round(max(values), digits)}

    by_mode = {m: sorted((r for r in results if r.mode == m), key=lambda r: r.round) for m in MODES}
    by_mode = {m: rs for m, rs in by_mode.items() if rs}
    speedups = {}  # the default step over each baseline, paired by round
    for base in BASELINES:
        if base in by_mode:
            pairs = list(zip(by_mode["fast"], by_mode[base], strict=True))
            speedups[f"speedup_fast_over_{base}"] = spread([f.tokens_per_second / b.tokens_per_second
                                                            for f, b in pairs])
            speedups[f"speedup_fast_over_{base}_cpu"] = spread([f.tokens_per_cpu_second / b.tokens_per_cpu_second
                                                                for f, b in pairs])
    return {
        "step_weight_bytes": active,
        "threads": threads,
        "rounds": len(by_mode["fast"]),
        "modes": {m: {"tokens_per_second": spread([r.tokens_per_second for r in rs], 1),
                      "share_of_limit": spread([r.share for r in rs]),
                      "tokens_per_cpu_second": spread([r.tokens_per_cpu_second for r in rs], 1),
                      "share_of_limit_cpu": spread([r.share_cpu for r in rs]),
                      "step_ms": spread([r.step_ms_median for r in rs]),
                      "read_gbs": spread([r.read_gbs for r in rs], 2),
                      "limit_tokens_per_second": spread([r.limit_tokens_per_second for r in rs], 0)}
                  for m, rs in by_mode.items()},
        **speedups,
        "per_round": [dict(asdict(r), tokens_per_second=round(r.tokens_per_second, 2), share=round(r.share, 4),
                           share_cpu=round(r.share_cpu, 4)) for r in results],
    }


def markdown(summary: dict, command: str) -> str:
    lines = [f"Single-stream plain decoding, share of the step limit (`{command}`; "
             f"{summary['rounds']} interleaved rounds, median [min, max]; {summary['threads']} intra-op thread(s); "
             f"{summary['step_weight_bytes'] / 1e6:.2f} MB of weights per token)",
             "", "| step | tokens/s | decode step ms | cache read GB/s | limit tokens/s | share of limit | "
                 "share of limit, CPU time |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda s, d: f"{s['median']:.{d}f} [{s['min']:.{d}f}, {s['max']:.{d}f}]"  # noqa: E731
    names = {"reference": "eager step (`fast_step=False`)",
             "eager_attention": "fast step, eager attention (`fused_attention=False`)",
             "fp32_math": "fast step, float32 products (`math=\"fp32\"`)",
             "fast": "fast step, fused attention (default)"}
    for mode, m in summary["modes"].items():
        lines.append(f"| {names[mode]} | {fmt(m['tokens_per_second'], 1)} | {fmt(m['step_ms'], 2)} | "
                     f"{fmt(m['read_gbs'], 1)} | {fmt(m['limit_tokens_per_second'], 0)} | "
                     f"{fmt(m['share_of_limit'], 3)} | {fmt(m['share_of_limit_cpu'], 3)} |")
    lines.append("")
    for base in BASELINES:
        if f"speedup_fast_over_{base}" in summary:
            lines.append(f"- default / {names[base]}, tokens/s paired by round: "
                         f"{fmt(summary[f'speedup_fast_over_{base}'], 2)}x "
                         f"(by CPU time {fmt(summary[f'speedup_fast_over_{base}_cpu'], 2)}x)")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode, marker, color in zip(MODES, ("s", "^", "D", "o"), ("C0", "C2", "C3", "C1"), strict=True):
        rounds = [r for r in summary["per_round"] if r["mode"] == mode]
        ax.plot([r["round"] for r in rounds], [r["share"] for r in rounds], marker=marker, color=color,
                label=f"{mode} step, wall")
        ax.plot([r["round"] for r in rounds], [r["share_cpu"] for r in rounds], marker=marker, color=color, ls=":",
                label=f"{mode} step, CPU time")
    ax.set(xlabel="round (interleaved)", ylabel="tokens/s / step limit", ylim=(0, None),
           title="Plain decoding as a share of the step limit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
