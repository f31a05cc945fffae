"""Single-stream plain decoding as a share of the machine's memory-bandwidth limit.

The limit: a plain decode step must read every weight the token touches at least once, so no
engine decodes faster than (copy bandwidth) / (active weight bytes per token). Active bytes are
counted from the model's shapes (`active_weight_bytes`); the bandwidth is measured in the same run,
right before each measurement (`copy_bandwidth`), so load from anything else on the machine moves
the limit and the speed together. The KV cache (a few hundred kB at these context lengths) and
activations are left out: the limit is an upper bound.

Every figure comes twice: by wall time (what a client sees) and by this process's CPU time (time
the kernel did not run us is left out; memory stalls still count). On a machine shared with other
busy processes the wall figures swing with their load and the CPU figures much less.

`bandwidth_share` runs three steps round by round, rotating which goes first, on the same prompts
with greedy sampling (all emit the same tokens), and reports every round, so the spread is visible
next to the medians: the default fast step, the same with eager attention (`EngineConfig.
fused_attention=False`: the fast step before attention moved into the kernel) and the previous
eager step (`EngineConfig.fast_step=False`). Speed-ups pair the default with each, round by round.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from service.types import DraftPolicy, GenerationRequest, SamplingParams

# Which EngineConfig each mode runs; "fast" is the default and the one the others are compared to.
MODES = {"reference": dict(fast_step=False), "eager_attention": dict(fused_attention=False),
         "fp32_math": dict(math="fp32"), "fast": {}}
BASELINES = ("reference", "eager_attention", "fp32_math")
TARGET_SHARE = 0.25


def active_weight_bytes(cfg, bytes_per_param: int = 4) -> int:
    """Weight bytes one plain decode step (one position) reads from a Qwen2-MoE config."""
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    A, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attention = H * (A + 2 * K) * D + (A + 2 * K) * D + A * D * H  # q/k/v weights + biases, o
    norms = 2 * H
    if cfg.is_moe:
        m, I, Is, E = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, \
            cfg.num_experts
        ffn = (E + 1) * H + m * 3 * H * I + 3 * H * Is  # router + shared gate, m routed experts, shared expert
    else:
        ffn = 3 * H * cfg.intermediate_size
    per_token = H + L * (attention + norms + ffn) + H + V * H  # embedding row, layers, final norm, lm_head
    return per_token * bytes_per_param


def copy_bandwidth(megabytes: int = 256, repeats: int = 3) -> tuple[float, float]:
    """Bytes per second of a large tensor copy (read + write counted, as STREAM's copy), by wall and
    by CPU time, medians of `repeats`; the buffer is far larger than the last-level cache, copied with
    torch's current threads."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page before timing
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        dst.copy_(src)
        wall.append(2 * src.numel() * 4 / (time.perf_counter() - t0))
        cpu.append(2 * src.numel() * 4 / max(time.process_time() - c0, 1e-9))
    return statistics.median(wall), statistics.median(cpu)


@dataclass
class Round:
    mode: str
    round: int
    tokens: int
    seconds: float  # wall time of the generate calls
    cpu_seconds: float  # this process's CPU time over the same calls
    step_ms_median: float  # plain decode steps alone (StepRecord.verify_seconds, wall)
    bandwidth_gbs: float  # wall
    bandwidth_cpu_gbs: float
    active_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_cpu_second(self) -> float:
        return self.tokens / self.cpu_seconds

    @property
    def limit_tokens_per_second(self) -> float:
        return self.bandwidth_gbs * 1e9 / self.active_bytes

    @property
    def share(self) -> float:
        return self.tokens_per_second / self.limit_tokens_per_second

    @property
    def share_cpu(self) -> float:
        return self.tokens_per_cpu_second / (self.bandwidth_cpu_gbs * 1e9 / self.active_bytes)


def bandwidth_share(prompts: list[str], max_new: int, rounds: int, threads: int) -> dict:
    from service.engine import Engine, EngineConfig

    engines = {mode: Engine(EngineConfig(threads=threads, **overrides)) for mode, overrides in MODES.items()}
    if engines["fast"].step_kind != "fast":
        raise RuntimeError("the fused kernel did not build here (no C compiler?): nothing to compare")
    active = active_weight_bytes(engines["fast"].target.cfg)
    greedy = SamplingParams(temperature=0)
    for engine in engines.values():  # warm-up: first calls pay one-off allocations
        engine.generate(GenerationRequest(prompt=prompts[0], max_new_tokens=8, sampling=greedy), DraftPolicy())
    results: list[Round] = []
    for r in range(rounds):
        order = list(MODES)
        for mode in order[r % len(order):] + order[:r % len(order)]:
            bandwidth, bandwidth_cpu = copy_bandwidth()
            tokens, seconds, cpu, steps = 0, 0.0, 0.0, []
            for prompt in prompts:
                t0, c0 = time.perf_counter(), time.process_time()
                out = engines[mode].generate(GenerationRequest(prompt=prompt, max_new_tokens=max_new,
                                                               sampling=greedy), DraftPolicy())
                seconds += time.perf_counter() - t0
                cpu += time.process_time() - c0
                tokens += out.completion_tokens
                steps += [s.verify_seconds for s in out.steps]
            results.append(Round(mode, r, tokens, seconds, cpu, 1e3 * statistics.median(steps), bandwidth / 1e9,
                                 bandwidth_cpu / 1e9, active))
    return summarize(results, active, threads)


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
        "active_weight_bytes_per_token": active,
        "threads": threads,
        "rounds": len(by_mode["fast"]),
        "target_share": TARGET_SHARE,
        "modes": {m: {"tokens_per_second": spread([r.tokens_per_second for r in rs], 1),
                      "share_of_limit": spread([r.share for r in rs]),
                      "tokens_per_cpu_second": spread([r.tokens_per_cpu_second for r in rs], 1),
                      "share_of_limit_cpu": spread([r.share_cpu for r in rs]),
                      "step_ms": spread([r.step_ms_median for r in rs]),
                      "bandwidth_gbs": spread([r.bandwidth_gbs for r in rs], 2),
                      "bandwidth_cpu_gbs": spread([r.bandwidth_cpu_gbs for r in rs], 2),
                      "limit_tokens_per_second": spread([r.limit_tokens_per_second for r in rs], 0)}
                  for m, rs in by_mode.items()},
        **speedups,
        "per_round": [dict(asdict(r), tokens_per_second=round(r.tokens_per_second, 2), share=round(r.share, 4),
                           share_cpu=round(r.share_cpu, 4)) for r in results],
    }


def markdown(summary: dict, command: str) -> str:
    lines = [f"Single-stream plain decoding, share of the memory-bandwidth limit (`{command}`; "
             f"{summary['rounds']} interleaved rounds, median [min, max]; {summary['threads']} intra-op thread(s); "
             f"{summary['active_weight_bytes_per_token'] / 1e6:.2f} MB of weights per token)",
             "", "| step | tokens/s | decode step ms | copy GB/s | limit tokens/s | share of limit | "
                 "share of limit, CPU time |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda s, d: f"{s['median']:.{d}f} [{s['min']:.{d}f}, {s['max']:.{d}f}]"  # noqa: E731
    names = {"reference": "eager step (`fast_step=False`)",
             "eager_attention": "fast step, eager attention (`fused_attention=False`)",
             "fp32_math": "fast step, float32 products (`math=\"fp32\"`)",
             "fast": "fast step, fused attention (default)"}
    for mode, m in summary["modes"].items():
        lines.append(f"| {names[mode]} | {fmt(m['tokens_per_second'], 1)} | {fmt(m['step_ms'], 2)} | "
                     f"{fmt(m['bandwidth_gbs'], 1)} | {fmt(m['limit_tokens_per_second'], 0)} | "
                     f"{fmt(m['share_of_limit'], 3)} | {fmt(m['share_of_limit_cpu'], 3)} |")
    lines.append("")
    for base in BASELINES:
        if f"speedup_fast_over_{base}" in summary:
            lines.append(f"- default / {names[base]}, tokens/s paired by round: "
                         f"{fmt(summary[f'speedup_fast_over_{base}'], 2)}x "
                         f"(by CPU time {fmt(summary[f'speedup_fast_over_{base}_cpu'], 2)}x)")
    lines.append(f"- target share >= {summary['target_share']}")
    # The limit counts fp32 weights (the definition); the fused kernels read the matrices as bf16
    # panels where the checkpoint is bf16 (or for bf16 arithmetic), so they move about half these bytes.
    fast = summary["modes"].get("fast")
    if fast is not None:
        lines.append(f"- the default step's kernels read the weight matrices as bf16, "
                     f"about half the bytes the limit counts: against a bf16 limit its share is about "
                     f"{fast['share_of_limit']['median'] / 2:.3f}")
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
    ax.axhline(summary["target_share"], color="grey", ls="--", label="target")
    ax.set(xlabel="round (interleaved)", ylabel="tokens/s / bandwidth limit", ylim=(0, None),
           title="Plain decoding as a share of the bandwidth limit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
