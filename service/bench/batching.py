"""Speculation under continuous batching: seconds per committed token and the batch union of
experts, per draft policy and concurrency, on one in-process Engine with its default configuration.

Each cell = one policy at one concurrency: `max(requests, 2 * C)` greedy requests from C caller
threads at once (the engine batches whatever is in flight). Cells run interleaved (round after
round over every policy and concurrency) so drift on a shared machine hits all alike; figures are
medians over rounds with the spread (min..max) beside them.

- seconds per committed token = wall time of the cell / tokens committed in it (what a token costs
  the server at that load; at C=1 it is the single-stream figure);
- batch union per layer = distinct routed experts of a whole pass (every position of every request
  in it), averaged over the cell's passes, beside the mean positions per pass and the union that
  uniform routing would give for that many positions: E * (1 - (1 - m/E)^positions).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from service.types import Drafter, DraftPolicy, GenerationRequest

POLICIES: tuple[tuple[str, DraftPolicy], ...] = (
    ("plain", DraftPolicy(policy_id="plain")),
    *((f"ngram k={k}", DraftPolicy(Drafter.NGRAM, k, policy_id=f"ngram-{k}")) for k in (2, 4, 8)),
    *((f"model k={k} T=0", DraftPolicy(Drafter.MODEL, k, 0.0, policy_id=f"model-{k}")) for k in (1, 2, 3, 4)),
)


@dataclass(frozen=True)
class Cell:
    policy: str
    drafter: str
    draft_length: int
    concurrency: int
    requests: int
    ms_per_committed_token: float  # median over rounds of wall / committed
    ms_per_committed_token_min: float
    ms_per_committed_token_max: float
    tokens_per_s: float  # median over rounds
    acceptance: float  # accepted / drafted over every round (0 for plain)
    mean_batch_size: float  # requests per pass
    mean_positions: float  # tokens per pass
    batch_unique_experts: tuple[float, ...]  # [L] mean over passes
    request_unique_experts: tuple[float, ...]  # [L] mean over the requests' own windows
    uniform_unique_experts: float  # E * (1 - (1 - m/E)^mean_positions)
    rounds: int


def uniform_union(num_experts: int, top_k: int, positions: float) -> float:
    """Expected distinct experts when each of `positions` tokens picks top_k of num_experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** positions)


def bench_policies(engine, workload: list[GenerationRequest], concurrency: tuple[int, ...] = (1, 4, 16),
                   rounds: int = 2, policies=POLICIES) -> list[Cell]:
    info = engine.info
    runs: dict[tuple[str, int], list[tuple[float, int, list]]] = {}
    for _ in range(rounds):
        for label, policy in policies:
            for c in concurrency:
                jobs = [workload[i % len(workload)] for i in range(max(len(workload), 2 * c))]
                t0 = time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    results = list(pool.map(lambda r, p=policy: engine.generate(r, p), jobs))
                runs.setdefault((label, c), []).append((time.perf_counter() - t0, len(jobs), results))
    cells = []
    for label, policy in policies:
        for c in concurrency:
            rows = runs[(label, c)]
            steps = [s for _, _, results in rows for r in results for s in r.steps]
            passes = list({id(s.batch): s.batch for s in steps}.values())
            ms = [1000 * wall / sum(s.committed for r in results for s in r.steps) for wall, _, results in rows]
            tps = [sum(r.completion_tokens for r in results) / wall for wall, _, results in rows]
            drafted = sum(s.drafted for s in steps)
            positions = statistics.mean(b.positions for b in passes)
            L = info.num_layers
            cells.append(Cell(
                policy=label, drafter=policy.drafter.value, draft_length=policy.draft_length, concurrency=c,
                requests=rows[0][1], ms_per_committed_token=statistics.median(ms),
                ms_per_committed_token_min=min(ms), ms_per_committed_token_max=max(ms),
                tokens_per_s=statistics.median(tps),
                acceptance=sum(s.accepted for s in steps) / drafted if drafted else 0.0,
                mean_batch_size=statistics.mean(b.batch_size for b in passes), mean_positions=positions,
                batch_unique_experts=tuple(statistics.mean(b.unique_experts[i] for b in passes) for i in range(L)),
                request_unique_experts=tuple(statistics.mean(s.unique_experts[i] for s in steps) for i in range(L)),
                uniform_unique_experts=uniform_union(info.num_experts, info.top_k, positions), rounds=rounds))
    return cells


def format_table(cells: list[Cell]) -> str:
    lines = [
        "| policy | concurrency | ms / committed token (min..max) | tokens/s | acceptance | requests / pass "
        "| positions / pass | batch union per layer | uniform routing | own window union per layer |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for x in cells:
        lines.append(
            f"| {x.policy} | {x.concurrency} | {x.ms_per_committed_token:.2f} ({x.ms_per_committed_token_min:.2f}.."
            f"{x.ms_per_committed_token_max:.2f}) | {x.tokens_per_s:.1f} | {x.acceptance:.2f} | "
            f"{x.mean_batch_size:.1f} | {x.mean_positions:.1f} | "
            f"{' / '.join(f'{u:.1f}' for u in x.batch_unique_experts)} | {x.uniform_unique_experts:.1f} | "
            f"{' / '.join(f'{u:.1f}' for u in x.request_unique_experts)} |")
    return "\n".join(lines)
