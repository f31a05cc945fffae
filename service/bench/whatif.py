"""`moespec bench whatif`: how well the what-if replay predicts shorter draft lengths.

For the n-gram drafter and the model drafter (temperature --draft-temperature), in one run:
record the steps of the largest length k, and run each shorter k' for real on the same prompts,
interleaved (per round, per prompt: k, then every k'), greedy requests and server defaults.
The prediction uses only the k-run's steps; the k' figures are measured. Per k' it prints the
predicted (replay and truncated-step estimates) and measured seconds per committed token, the
committed tokens per step and window per step behind each, and the error of the prediction from
all rounds' k-runs against all rounds' k'-runs. Each round is also an independent pair (its own
k-run predicts its own k'-runs, on the same prompts, policies back to back per prompt in a rotating
order): the per-round errors' median and min-max are the spread reported. Writes whatif-bench.json to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from service.bench.engine import load_prompts
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from service.whatif.predict import predict

GREEDY = SamplingParams(temperature=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=6, help="how many shipped held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--record-length", type=int, default=8, help="the recorded run's draft length k")
    parser.add_argument("--lengths", default="0,1,2,3,4,6", help="shorter draft lengths k' to run for real")
    parser.add_argument("--draft-temperature", type=float, default=0.0, help="the model drafter's temperature")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats (the spread is over these)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", default="reports/bench", help="folder for whatif-bench.json")


def _cost(steps) -> float:
    return sum(s.seconds for s in steps) / max(1, sum(s.committed for s in steps))


def run(args: argparse.Namespace) -> int:
    from service.engine import Engine, EngineConfig
    from service.errors import UsageError

    lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    if not lengths or min(lengths) < 0 or max(lengths) >= args.record_length:
        raise UsageError(f"--lengths must be in [0, --record-length={args.record_length}), got {args.lengths}")
    engine = Engine(EngineConfig(threads=args.threads, capture_topk=True))
    prompts = load_prompts(args.prompts)
    results = []
    for drafter in (Drafter.NGRAM, Drafter.MODEL):
        temp = args.draft_temperature if drafter is Drafter.MODEL else 0.0
        policies = [DraftPolicy(drafter, k, temp, policy_id=f"{drafter.value}-{k}")
                    for k in (args.record_length, *lengths)]
        runs: dict[int, list[list]] = {p.draft_length: [[] for _ in range(args.rounds)] for p in policies}
        recorded = []  # requests of the k-run
        for r in range(args.rounds):
            for j, prompt in enumerate(prompts):
                # Each prompt's policies back to back, the order rotated so that no policy always
                # runs first or after the same one (load on a shared machine drifts within a round).
                shift = (r * len(prompts) + j) % len(policies)
                for policy in policies[shift:] + policies[:shift]:
                    request = GenerationRequest(prompt=prompt, max_new_tokens=args.max_new_tokens, sampling=GREEDY)
                    result = engine.generate(request, policy)
                    runs[policy.draft_length][r].extend(result.steps)
                    if policy.draft_length == args.record_length:
                        recorded.append(result.steps)
        prediction = predict(recorded, engine.info.top_k)
        by_k = {p.draft_length: p for p in prediction.predictions}
        per_round = len(prompts)  # requests of the k-run in each round
        round_predictions = [{p.draft_length: p for p in predict(
            recorded[r * per_round:(r + 1) * per_round], engine.info.top_k).predictions} for r in range(args.rounds)]
        for k in (*lengths, args.record_length):
            rounds = [_cost(steps) for steps in runs[k]]
            round_errors = [round_predictions[r][k].seconds_per_committed_token / rounds[r] - 1
                            for r in range(args.rounds)]
            round_errors_truncated = [round_predictions[r][k].seconds_per_committed_token_truncated / rounds[r] - 1
                                      for r in range(args.rounds)]
            steps = [s for steps in runs[k] for s in steps]
            measured = _cost(steps)
            p = by_k[k]
            results.append({
                "drafter": drafter.value, "draft_temperature": temp, "recorded_length": args.record_length,
                "draft_length": k, "measured_seconds_per_committed_token": measured,
                "measured_spread": [min(rounds), max(rounds)],
                "predicted_replay": p.seconds_per_committed_token,
                "predicted_truncated": p.seconds_per_committed_token_truncated,
                "error_replay": p.seconds_per_committed_token / measured - 1,
                "error_truncated": p.seconds_per_committed_token_truncated / measured - 1,
                "round_errors_replay": round_errors, "round_errors_truncated": round_errors_truncated,
                "measured_window_per_step": sum(s.window for s in steps) / len(steps),
                "predicted_window_per_step": p.replay_window_mean,
                "measured_committed_per_step": sum(s.committed for s in steps) / len(steps),
                "predicted_committed_per_step": p.committed_per_step,
                "predicted_committed_per_step_truncated": p.committed_per_step_truncated,
                "measured_step_seconds": sum(s.seconds for s in steps) / len(steps),
                "predicted_step_seconds": p.draft_seconds_per_step + p.verify_seconds_per_step,
                "measured_draft_seconds_per_step": sum(s.draft_seconds for s in steps) / len(steps),
                "predicted_draft_seconds_per_step": p.draft_seconds_per_step,
                "measured_verify_seconds_per_step": sum(s.verify_seconds for s in steps) / len(steps),
                "predicted_verify_seconds_per_step": p.verify_seconds_per_step,
            })
        print(f"\n{drafter.value} drafter (T={temp}), recorded at k={args.record_length}: "
              f"{prediction.steps} steps; predicted best k'={prediction.best.draft_length}")
        print(f"{'k':>3} {'measured ms/tok (spread)':>26} {'replay':>8} {'err':>7} "
              f"{'per-round err median (min..max)':>32} {'truncated':>9} {'err':>7} {'per-round':>8} "
              f"{'window meas':>11} {'replay':>6} "
              f"{'tok/step meas':>13} {'replay':>7} {'trunc':>6} {'draft ms meas':>13} {'pred':>6} "
              f"{'verify ms meas':>14} {'pred':>6}")
        for row in (x for x in results if x["drafter"] == drafter.value):
            lo, hi = row["measured_spread"]
            errs, trunc_errs = row["round_errors_replay"], row["round_errors_truncated"]
            print(f"{row['draft_length']:>3} {row['measured_seconds_per_committed_token'] * 1e3:>9.3f} "
                  f"({lo * 1e3:.3f}-{hi * 1e3:.3f}) {row['predicted_replay'] * 1e3:>8.3f} "
                  f"{row['error_replay']:>+7.1%} "
                  f"{f'{statistics.median(errs):+.1%} ({min(errs):+.1%}..{max(errs):+.1%})':>32} "
                  f"{row['predicted_truncated'] * 1e3:>9.3f} "
                  f"{row['error_truncated']:>+7.1%} {statistics.median(trunc_errs):>+8.1%} "
                  f"{row['measured_window_per_step']:>11.2f} {row['predicted_window_per_step']:>6.2f} "
                  f"{row['measured_committed_per_step']:>13.2f} "
                  f"{row['predicted_committed_per_step']:>7.2f} {row['predicted_committed_per_step_truncated']:>6.2f} "
                  f"{row['measured_draft_seconds_per_step'] * 1e3:>13.3f} "
                  f"{row['predicted_draft_seconds_per_step'] * 1e3:>6.3f} "
                  f"{row['measured_verify_seconds_per_step'] * 1e3:>14.3f} "
                  f"{row['predicted_verify_seconds_per_step'] * 1e3:>6.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("prompts", "max_new_tokens", "record_length", "lengths",
                                               "draft_temperature", "rounds", "threads")}
    (out / "whatif-bench.json").write_text(json.dumps({"settings": settings, "rows": results}, indent=1))
    print(f"\nwrote {out / 'whatif-bench.json'}")
    return 0
