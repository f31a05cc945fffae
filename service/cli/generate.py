"""`moespec generate`: run the embedded engine in-process, print the completion and a per-step table."""

from __future__ import annotations

import argparse
import sys

from service.errors import UsageError
from service.policy.ids import cell_from_text
from service.policy.offers import check_offered
from service.types import (
    Controller,
    Drafter,
    DraftPolicy,
    GenerationRequest,
    GenerationResult,
    InvalidRequest,
    PolicyCell,
    SamplingParams,
)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", choices=[d.value for d in Drafter], default=Drafter.MODEL.value)
    parser.add_argument("--draft-length", type=int, default=0, help="draft tokens per step; 0 = plain decoding")
    parser.add_argument("--draft-temperature", type=float, default=1.0, help="model drafter only; 0 = argmax")
    add_controller_arguments(parser)


def add_controller_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    parser.add_argument("--controller", choices=[c.value for c in Controller], default=Controller.STATIC.value,
                        help=f"{prefix}who picks each step's draft length; with an adaptive one, --draft-length is "
                             "the most a step drafts (docs/server.md, 'Adaptive speculation')")
    parser.add_argument("--cost-weight", type=float, default=1.0,
                        help=f"{prefix}the moespec controller's weight on marginal cost (> 1 drafts less)")
    # Beside the controller: every command that takes a policy takes these, and a tree rules out the
    # adaptive controllers (DraftPolicy.validate says so).
    parser.add_argument("--tree-width", type=int, default=1, metavar="N",
                        help=f"{prefix}draft a tree instead of a chain: at each depth expand the N most likely "
                             "candidates of the nodes kept, within --draft-length nodes (model drafter, static "
                             "controller; 1 = a chain, the default; docs/server.md, 'Draft trees')")
    parser.add_argument("--cell", action="append", default=[], metavar="LABEL=POLICY_ID",
                        help=f"{prefix}a table cell (repeatable): steps in that context run that policy, e.g. "
                             "b1-1.greedy=ngram-k4 or b9+.any=plain (docs/server.md, 'Table policies')")


def cells_from_args(args: argparse.Namespace) -> tuple[PolicyCell, ...]:
    """--cell values -> cells (UsageError naming the malformed one)."""
    try:
        return tuple(cell_from_text(text) for text in args.cell)
    except ValueError as e:
        raise UsageError(f"--cell {e}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", help="prompt text; '-' reads standard input")
    add_sampling_arguments(parser)
    add_policy_arguments(parser)
    parser.add_argument("--no-table", action="store_true", help="print only the completion")


def request_from_args(args: argparse.Namespace) -> tuple[GenerationRequest, DraftPolicy]:
    prompt = sys.stdin.read() if args.prompt == "-" else (args.prompt or "")
    request = GenerationRequest(
        prompt=prompt, max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed),
    )
    policy = DraftPolicy(drafter=Drafter(args.drafter), draft_length=args.draft_length,
                         draft_temperature=args.draft_temperature, policy_id="cli",
                         controller=Controller(args.controller), cost_weight=args.cost_weight,
                         cells=cells_from_args(args), tree_width=args.tree_width)
    return request, policy


def step_table(result: GenerationResult) -> str:
    rows = ["step  drafted  accepted  committed  unique experts per layer   verify ms  decode-steps"]
    for i, s in enumerate(result.steps):
        experts = " ".join(f"{u:3d}" for u in s.unique_experts)
        rows.append(f"{i:4d}  {s.drafted:7d}  {s.accepted:8d}  {s.committed:9d}  {experts:<25s} "
                    f"{s.verify_seconds * 1e3:9.2f}  {s.decode_step_equivalents:12.2f}")
    spec = result.spec
    branches = (f" (one branch of the tree: [{', '.join(f'{u:.1f}' for u in spec.branch_unique_experts_mean)}])"
                if spec.branch_unique_experts_mean else "")
    rows.append(
        f"steps {spec.verify_steps}, accepted {spec.accepted_tokens}/{spec.drafted_tokens} drafted, "
        f"committed {spec.committed_tokens}, mean unique experts per layer "
        f"[{', '.join(f'{u:.1f}' for u in spec.unique_experts_mean)}]{branches}, "
        f"{spec.seconds_per_committed_token * 1e3:.2f} ms per committed token, finish {result.finish_reason.value}"
    )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    from service.engine import Engine, EngineConfig

    request, policy = request_from_args(args)
    try:
        request.validate(vocab_size=2**31, max_context=2**31)  # field checks before the model loads
        policy.validate()
    except InvalidRequest as e:
        raise UsageError(str(e)) from None
    engine = Engine(EngineConfig())
    try:
        check_offered(policy, engine.info)  # as the server would: a tree the engine cannot draft is refused
        result = engine.generate(request, policy)
    except InvalidRequest as e:
        raise UsageError(str(e)) from None
    print(result.text)
    if not args.no_table:
        print(step_table(result), file=sys.stderr)
    return 0
