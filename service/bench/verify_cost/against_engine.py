"""`moespec bench verify-cost --geometry target --against-engine`: the profile's predicted verify cost
beside the embedded engine's measured verify passes, for windows of 1..9 positions at the per-layer
unions the engine really routed, interleaved (a profile round, then an engine round over the held-out
prompts, and so on), so both see the same machine state.

The engine runs greedy held-out prompts with the n-gram drafter at k = 1, 2, 6 and 8 (it proposes up
to k tokens where the text repeats, none elsewhere: at k = 8 alone, windows of 2, 3 and 7 positions
hardly occur) and plain decoding, recording each pass's window, routed ids, verify seconds and
context. Each pass's prediction is the profile's fitted model at its window and mean union over layers,
scaled to the model's layers. A profile of the MoE blocks alone (`--context 0`) leaves out attention,
the embedding, the output layer and the verdict, which the engine's pass also runs, so its prediction
runs low by that share; a whole-pass profile (`--context C`, whole_pass.py) times all of them, at one
context where the engine's passes run at their own. Printed both ways: in seconds, and in plain decode
steps (each side divided by its own plain step), where a fixed share outside what the profile times
partly cancels; each window's median context is printed beside them."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from service.bench.verify_cost.fit import CostModel

WINDOW_MAX = 9
NGRAM_LENGTHS = (1, 2, 6, WINDOW_MAX - 1)


def heldout_prompts(count: int) -> list[str]:
    import json

    path = Path(__file__).resolve().parents[2] / "prompts" / "heldout.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()[:count]]


def engine_round(engine, prompts: list[str], max_new_tokens: int) -> list[tuple[int, float, float, int]]:
    """Every verify pass of the round -> (window, mean union over layers, verify seconds, context: the
    positions in the cache before the window)."""
    from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams

    passes = []
    policies = (*(DraftPolicy(Drafter.NGRAM, k, 0.0, f"ngram-k{k}") for k in NGRAM_LENGTHS),
                DraftPolicy(Drafter.MODEL, 0, 0.0, "plain"))
    for policy in policies:
        for prompt in prompts:
            result = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=max_new_tokens,
                                                       sampling=SamplingParams(temperature=0.0)), policy)
            context = result.prompt_tokens - 1  # the last prompt token opens the first window
            for s in result.steps:
                passes.append((s.window, statistics.fmean(s.unique_experts), s.verify_seconds, context))
                context += s.committed
    return passes


def median_context(passes: list[tuple[int, float, float, int]]) -> float:
    return statistics.median(p[3] for p in passes)


def compare(passes: list[tuple[int, float, float, int]], model: CostModel, scale: float, top_k: int) -> list[dict]:
    """Per window size: the engine's median verify seconds, the profile's median prediction, the error."""
    by_window: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for w, union, seconds, context in passes:
        if w <= WINDOW_MAX:
            by_window[w].append((seconds, model.seconds(w, union) * scale, context))
    if 1 not in by_window:
        raise RuntimeError("the engine recorded no plain decode step")
    plain_engine = statistics.median(s for s, _, _ in by_window[1])
    plain_profile = model.seconds(1, top_k) * scale
    rows = []
    for w in sorted(by_window):
        measured = statistics.median(s for s, _, _ in by_window[w])
        predicted = statistics.median(p for _, p, _ in by_window[w])
        context = statistics.median(c for *_, c in by_window[w])
        rows.append({"window": w, "passes": len(by_window[w]), "context": context,
                     "engine_seconds": measured,
                     "profile_seconds": predicted, "error": (predicted - measured) / measured,
                     "engine_plain_steps": measured / plain_engine, "profile_plain_steps": predicted / plain_profile,
                     "error_in_plain_steps": (predicted / plain_profile) / (measured / plain_engine) - 1})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'w':>2} {'passes':>6} {'context':>7} {'engine ms':>10} {'profile ms':>10} {'error':>7} "
             f"{'engine steps':>12} {'profile steps':>13} {'error':>7}"]
    for r in rows:
        lines.append(f"{r['window']:2d} {r['passes']:6d} {r['context']:7.0f} {r['engine_seconds'] * 1e3:10.3f} "
                     f"{r['profile_seconds'] * 1e3:10.3f} {r['error']:+7.1%} {r['engine_plain_steps']:12.2f} "
                     f"{r['profile_plain_steps']:13.2f} {r['error_in_plain_steps']:+7.1%}")
    return "\n".join(lines)
