"""`moespec whatif FILE`: predict the cost of every draft length k' <= k from one recorded run.

FILE is a step recording (`moespec serve --record-steps FILE`). Steps of tree policies are not replayed
(the replay predicts chains; the output says how many it skipped). Prints a table (acceptance per
position, committed tokens per step, per-layer unions, verify / draft ms, ms per committed token),
and writes FILE.whatif.json and FILE.whatif.png (or under --out). With --ep-size P the table adds
the expert-parallel view of each k' (ranks touched per layer, dispatch bytes per committed token).
With --cost-profile P (written by `moespec bench verify-cost`) every verify pass is priced by the
profile's fitted model at its window and recorded unions instead of the recording's own timings: what
the recorded routing would cost on the profile's machine and geometry (approximations:
service/whatif/profile_pricing.py).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from service.errors import UsageError
from service.recording import RecordingError, read_recording
from service.routing import expert_parallel
from service.whatif import present
from service.whatif.predict import predict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="step recording written by `moespec serve --record-steps`")
    parser.add_argument("--policy", default=None,
                        help="policy id to replay (default: the one with the most recorded chain steps)")
    parser.add_argument("--ep-size", type=int, default=0, help="also estimate expert parallelism over P ranks")
    parser.add_argument("--ep-placement", type=Path, default=None,
                        help="physical-to-logical map [layers, slots] (.pt or .json, SGLang's shape); "
                             "default: contiguous blocks of experts per rank")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for whatif.json / whatif.png (default: beside FILE)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the replay's draws of untested positions")
    parser.add_argument("--cost-profile", type=Path, default=None,
                        help="price verify passes with this verify-cost profile (moespec bench verify-cost) "
                             "instead of the recording's timings")


def run(args: argparse.Namespace) -> int:
    if args.ep_size < 0:
        raise UsageError(f"--ep-size must be >= 1 (or 0 for off), got {args.ep_size}")
    if args.ep_placement is not None and not args.ep_size:
        raise UsageError("--ep-placement needs --ep-size")
    try:
        recording = read_recording(args.file)
    except RecordingError as e:
        raise UsageError(str(e)) from None
    header = recording.header
    counts = Counter(s.policy_id for s in recording.steps)
    if not counts:
        raise UsageError(f"{args.file}: the recording holds no steps")
    # The default is the policy with the most chain steps: the replay predicts chains only.
    chains = Counter(s.policy_id for s in recording.steps if s.tree_width == 1)
    policy = args.policy or (chains or counts).most_common(1)[0][0]
    if policy not in counts:
        raise UsageError(f"--policy {policy!r} is not in the recording (it has: {', '.join(sorted(counts))})")
    selected = (tuple(s for s in request if s.policy_id == policy) for request in recording.requests)
    requests = [r for r in selected if r]
    placement = None
    if args.ep_size:
        try:
            p2l = expert_parallel.load_placement_map(args.ep_placement) if args.ep_placement else None
            placement = expert_parallel.make_placement(args.ep_size, header["num_layers"], header["num_experts"], p2l)
        except expert_parallel.PlacementError as e:
            raise UsageError(str(e)) from None
    pricing = None
    if args.cost_profile is not None:
        from service.bench.verify_cost.profile import ProfileError, load_profile
        from service.whatif.profile_pricing import ProfilePricing

        try:
            pricing = ProfilePricing(load_profile(args.cost_profile), header["top_k"], header["num_experts"])
        except ProfileError as e:
            raise UsageError(f"--cost-profile: {e}") from None
    try:
        result = predict(requests, header["top_k"], placement,
                         header.get("hidden_size", 0) * expert_parallel.ACTIVATION_BYTES, args.seed, pricing)
    except ValueError as e:
        raise UsageError(f"{args.file}: {e}") from None
    print(present.format_table(result))
    out = args.out or args.file.parent
    stem = "whatif" if args.out else f"{args.file.name}.whatif"
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    json_path.write_text(json.dumps({"policy_id": policy, "model": header.get("model"), **result.to_json()}, indent=1))
    present.plot(result, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0
