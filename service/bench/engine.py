"""`moespec bench engine`: the embedded engine's figures, measured side by side in one run.

- tokens/s and seconds per committed token for plain decoding, the model drafter at every draft
  length and a few draft temperatures, and the n-gram drafter at every draft length;
- transformers' own `generate()` on the same checkpoints (plain, and assisted generation with its
  `heuristic` schedule), when transformers is installed;
- verify cost in plain-decode-step equivalents by window size and by unique experts;
- the overhead of routing capture (on vs off, interleaved);
- single-stream plain decoding as a share of the step limit (limit.py: the step's bytes and flops at
  this machine's cache-resident read and FMA rates, measured in the same run), the fast step against
  the same with eager attention (`EngineConfig.fused_attention`), float32 products and the eager step
  (`EngineConfig.fast_step`), interleaved round by round (`bandwidth_share`).

Greedy decoding throughout, so every mode produces the same tokens and only speed differs. Every
engine runs with the thread count `moespec serve` would pick here (engine.threads).
Writes bench.json, bench.md, bench.png and bandwidth.png to --out and prints a table;
`--only-bandwidth` runs the last section alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0)


@dataclass
class Row:
    mode: str
    drafter: str
    draft_length: int
    draft_temperature: float
    tokens: int
    seconds: float
    seconds_per_committed_token: float
    acceptance: float  # accepted / drafted
    proposals_per_step: float
    empty_draft_steps: int
    unique_experts_mean: list[float]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=8, help="how many shipped held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="0,0.5,1.0", help="draft temperatures for the model drafter")
    parser.add_argument("--max-draft-length", type=int, default=8)
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--out", default="reports/bench", help="folder for bench.json and bench.png")
    parser.add_argument("--bandwidth-rounds", type=int, default=6,
                        help="interleaved rounds of the step-limit share section (fast vs the other steps)")
    parser.add_argument("--only-bandwidth", action="store_true",
                        help="run only the step-limit share section (writes bandwidth.json / .md / .png)")


def load_prompts(count: int) -> list[str]:
    path = Path(__file__).resolve().parent.parent / "prompts" / "heldout.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()[:count]]


def run_policy(engine, prompts: list[str], max_new: int, policy: DraftPolicy, mode: str) -> tuple[Row, list]:
    steps, tokens, t0 = [], 0, time.perf_counter()
    for prompt in prompts:
        result = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=max_new, sampling=GREEDY), policy)
        steps.extend(result.steps)
        tokens += result.completion_tokens
    seconds = time.perf_counter() - t0
    drafted = sum(s.drafted for s in steps)
    layers = len(steps[0].unique_experts)
    row = Row(
        mode=mode, drafter=policy.drafter.value if policy.draft_length else "-", draft_length=policy.draft_length,
        draft_temperature=policy.draft_temperature if policy.drafter is Drafter.MODEL and policy.draft_length else 0.0,
        tokens=tokens, seconds=seconds,
        seconds_per_committed_token=sum(s.seconds for s in steps) / max(1, sum(s.committed for s in steps)),
        acceptance=sum(s.accepted for s in steps) / drafted if drafted else 0.0,
        proposals_per_step=drafted / len(steps),
        empty_draft_steps=sum(1 for s in steps if policy.draft_length and not s.drafted),
        unique_experts_mean=[round(statistics.fmean(s.unique_experts[i] for s in steps), 2) for i in range(layers)],
    )
    return row, steps


def transformers_rows(prompts: list[str], max_new: int) -> list[Row]:
    import torch
    import transformers

    from service.engine.model.weights import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR

    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_TARGET_DIR)
    target = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET_DIR, dtype=torch.float32).eval()
    draft = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_DRAFT_DIR, dtype=torch.float32).eval()
    rows = []
    for mode, assistant in (("transformers plain", None), ("transformers assisted (heuristic)", draft)):
        if assistant is not None:
            assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
        tokens, t0 = 0, time.perf_counter()
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt")
            with torch.inference_mode():
                out = target.generate(**ids, max_new_tokens=max_new, do_sample=False, assistant_model=assistant,
                                      pad_token_id=tok.eos_token_id)
            tokens += out.shape[1] - ids["input_ids"].shape[1]
        seconds = time.perf_counter() - t0
        rows.append(Row(mode, "model" if assistant else "-", 0, 0.0, tokens, seconds, seconds / tokens,
                        0.0, 0.0, 0, []))
    return rows


def capture_overhead(prompts: list[str], max_new: int, threads: int, rounds: int = 6) -> dict:
    """Routing capture on vs off: two engines alternate request by request (order flipped every
    round) so the machine's drift hits both alike; the overhead is the ratio of summed times."""
    from service.engine import Engine, EngineConfig

    engines = {capture: Engine(EngineConfig(capture_routing=capture, threads=threads)) for capture in (True, False)}
    seconds = {True: 0.0, False: 0.0}
    policy = DraftPolicy(draft_length=4, draft_temperature=0)
    for round_ in range(rounds):
        for prompt in prompts:
            for capture in ((True, False) if round_ % 2 else (False, True)):
                request = GenerationRequest(prompt=prompt, max_new_tokens=max_new, sampling=GREEDY)
                t0 = time.perf_counter()
                engines[capture].generate(request, policy)
                seconds[capture] += time.perf_counter() - t0
    # The capture's own work, timed alone on a 5-position window, as a share of a plain decode step.
    from service.engine.step_records import unique_experts_per_layer

    engine = engines[True]
    routed = torch.randint(0, engine.info.num_experts, (engine.info.num_layers, 5, engine.info.top_k))
    t0, n = time.perf_counter(), 2000
    for _ in range(n):
        unique_experts_per_layer(routed, engine.info.num_experts)
    direct = (time.perf_counter() - t0) / n
    return {"seconds_capture_on": round(seconds[True], 3), "seconds_capture_off": round(seconds[False], 3),
            "overhead_percent": round(100 * (seconds[True] / seconds[False] - 1), 2),
            "direct_us_per_step": round(direct * 1e6, 1),
            "direct_percent_of_decode_step": round(100 * direct / engine.decode_step_seconds, 2)}


def verify_cost_curves(steps: list) -> dict:
    """Decode-step equivalents of a verify pass by window size and by mean unique experts per layer."""
    by_window: dict[int, list[float]] = {}
    by_union: dict[int, list[float]] = {}
    for s in steps:
        by_window.setdefault(s.window, []).append(s.decode_step_equivalents)
        union = round(statistics.fmean(s.unique_experts) / 4) * 4  # 4-expert bins
        by_union.setdefault(union, []).append(s.decode_step_equivalents)
    med = lambda d: {k: round(statistics.median(v), 2) for k, v in sorted(d.items())}  # noqa: E731
    return {"by_window": med(by_window), "by_unique_experts": med(by_union)}


def print_table(rows: list[Row]) -> None:
    print(f"{'mode':<36} {'tok/s':>7} {'ms/tok':>7} {'accept':>6} {'prop/step':>9} {'empty':>5}  unique experts/layer")
    for r in rows:
        experts = " ".join(f"{u:5.1f}" for u in r.unique_experts_mean)
        print(f"{r.mode:<36} {r.tokens_per_second:7.1f} {r.seconds_per_committed_token * 1e3:7.2f} "
              f"{r.acceptance:6.2f} {r.proposals_per_step:9.2f} {r.empty_draft_steps:5d}  {experts}")


def markdown(rows: list[Row], summary: dict) -> str:
    """The table and headline figures as Markdown (what the README quotes)."""
    lines = ["| mode | drafter | k | draft T | tokens/s | ms / committed token | acceptance | drafted / step | "
             "unique experts / layer |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        experts = " / ".join(f"{u:.1f}" for u in r.unique_experts_mean)
        lines.append(f"| {r.mode} | {r.drafter} | {r.draft_length} | {r.draft_temperature:g} | "
                     f"{r.tokens_per_second:.1f} | {r.seconds_per_committed_token * 1e3:.2f} | {r.acceptance:.2f} | "
                     f"{r.proposals_per_step:.2f} | {experts} |")
    curves = summary["verify_cost_decode_steps"]
    fmt = lambda d: ", ".join(f"{k}: {v}" for k, v in d.items())  # noqa: E731
    lines += [
        "",
        f"- plain decode step: {summary['decode_step_ms']} ms; best policy: {summary['best_policy']}",
        f"- best policy vs best transformers mode: {summary['best_vs_best_transformers'] or 'not measured'}x tokens/s",
        f"- verify cost in plain decode steps by window size: {fmt(curves['by_window'])}",
        f"- ... by mean unique experts per layer: {fmt(curves['by_unique_experts'])}",
        f"- routing capture: {summary['routing_capture']['overhead_percent']}% end to end (on vs off, "
        f"alternating); its own work {summary['routing_capture']['direct_us_per_step']} us per step = "
        f"{summary['routing_capture']['direct_percent_of_decode_step']}% of a plain decode step",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    plain = next(r for r in rows if r.mode == "plain")
    ax1.axhline(plain.tokens_per_second, color="black", ls="--", label="plain decoding")
    for name, group in _series(rows).items():
        ax1.plot([r.draft_length for r in group], [r.tokens_per_second for r in group], marker="o", label=name)
    for r in rows:
        if r.mode.startswith("transformers"):
            ax1.axhline(r.tokens_per_second, ls=":", color="grey")
            ax1.annotate(r.mode, (1, r.tokens_per_second), fontsize=7, color="grey")
    ax1.set(xlabel="draft length", ylabel="tokens/s", title="Throughput by policy (greedy)")
    ax1.legend(fontsize=7)
    windows = curves["by_window"]
    unions = curves["by_unique_experts"]
    ax2.plot(list(windows), list(windows.values()), marker="o", label="by window size (x = positions)")
    ax2.plot(list(unions), list(unions.values()), marker="s", label="by mean unique experts (x = experts)")
    ax2.set(xlabel="window positions / unique experts per layer", ylabel="verify cost (plain decode steps)",
            title="What a verify pass costs")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _series(rows: list[Row]) -> dict[str, list[Row]]:
    series: dict[str, list[Row]] = {}
    for r in rows:
        if r.mode == "speculative":
            name = "ngram" if r.drafter == "ngram" else f"model, draft T={r.draft_temperature:g}"
            series.setdefault(name, []).append(r)
    return series


def run_bandwidth(prompts: list[str], max_new: int, rounds: int, threads: int, out: Path) -> tuple[dict, str]:
    from service.bench import bandwidth

    summary = bandwidth.bandwidth_share(prompts, max_new, rounds, threads)
    text = bandwidth.markdown(summary, f"moespec bench engine --only-bandwidth --prompts {len(prompts)} "
                                       f"--max-new-tokens {max_new} --bandwidth-rounds {rounds}")
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bandwidth.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "bandwidth.md").write_text(text)
    bandwidth.plot(summary, out / "bandwidth.png")
    print(f"wrote {out / 'bandwidth.json'}, {out / 'bandwidth.md'} and {out / 'bandwidth.png'}")
    return summary, text


def run(args: argparse.Namespace) -> int:
    from service.engine import Engine, EngineConfig
    from service.engine.threads import default_threads
    from service.errors import UsageError

    try:
        temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise UsageError(f"--temperatures: not a comma-separated list of numbers: {args.temperatures!r}") from None
    if not 1 <= args.prompts <= 64 or args.max_new_tokens < 1 or not 0 <= args.max_draft_length <= 8:
        raise UsageError("--prompts must be 1..64, --max-new-tokens >= 1, --max-draft-length 0..8")
    if args.bandwidth_rounds < 1:
        raise UsageError(f"--bandwidth-rounds must be >= 1, got {args.bandwidth_rounds}")
    prompts = load_prompts(args.prompts)
    threads = default_threads()  # what `moespec serve` picks on this machine
    out = Path(args.out)
    if args.only_bandwidth:
        run_bandwidth(prompts, args.max_new_tokens, args.bandwidth_rounds, threads, out)
        return 0
    engine = Engine(EngineConfig(threads=threads))
    run_policy(engine, prompts[:2], 16, DraftPolicy(draft_length=2), "warm-up")
    rows, all_steps = [], []
    row, steps = run_policy(engine, prompts, args.max_new_tokens, DraftPolicy(), "plain")
    rows.append(row)
    all_steps += steps
    policies = [DraftPolicy(draft_length=k, draft_temperature=t) for t in temperatures
                for k in range(1, args.max_draft_length + 1)]
    policies += [DraftPolicy(drafter=Drafter.NGRAM, draft_length=k) for k in range(1, args.max_draft_length + 1)]
    for policy in policies:
        row, steps = run_policy(engine, prompts, args.max_new_tokens, policy, "speculative")
        rows.append(row)
        all_steps += steps
    if not args.no_transformers:
        try:
            rows += transformers_rows(prompts, args.max_new_tokens)
        except ImportError:
            print("transformers is not installed: skipping its baselines (pip install transformers)")
    curves = verify_cost_curves(all_steps)
    overhead = capture_overhead(prompts[:4], args.max_new_tokens, threads)
    share, share_text = run_bandwidth(prompts, args.max_new_tokens, args.bandwidth_rounds, threads, out)
    print_table(rows)
    best = max((r for r in rows if not r.mode.startswith("transformers")), key=lambda r: r.tokens_per_second)
    best_hf = max((r for r in rows if r.mode.startswith("transformers")), key=lambda r: r.tokens_per_second,
                  default=None)
    summary = {
        "decode_step_ms": round(engine.decode_step_seconds * 1e3, 3),
        "best_policy": {"drafter": best.drafter, "draft_length": best.draft_length,
                        "draft_temperature": best.draft_temperature,
                        "tokens_per_second": round(best.tokens_per_second, 1)},
        "best_vs_best_transformers": round(best.tokens_per_second / best_hf.tokens_per_second, 2) if best_hf else None,
        "verify_cost_decode_steps": curves,
        "routing_capture": overhead,
        "threads": threads,
        "bandwidth_share": {k: v for k, v in share.items() if k != "per_round"},
    }
    print(json.dumps(summary, indent=2))
    out.mkdir(parents=True, exist_ok=True)
    rows_json = [dict(r.__dict__, tokens_per_second=round(r.tokens_per_second, 2)) for r in rows]
    (out / "bench.json").write_text(json.dumps({"summary": summary, "rows": rows_json}, indent=2) + "\n")
    (out / "bench.md").write_text(markdown(rows, summary) + "\n" + share_text)
    plot(rows, curves, out / "bench.png")
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'} and {out / 'bench.png'}")
    return 0
