"""serve's --ep-size / --ep-placement flags -> the EPSpec the engine estimates with.

Beside service.routing.expert_parallel (the placement and cost model) so both backends read the flags the
same way without importing the command-line package.
"""

from __future__ import annotations

import argparse

from service.errors import UsageError
from service.routing import expert_parallel


def ep_spec(args: argparse.Namespace):
    """--ep-size / --ep-placement -> the EPSpec the engine estimates with (None: off); the file is read
    here, before the model loads, so a bad one exits 2 at once."""
    if args.ep_size < 0:
        raise UsageError(f"--ep-size must be >= 1 (or 0 for off), got {args.ep_size}")
    if args.ep_placement is not None and not args.ep_size:
        raise UsageError("--ep-placement needs --ep-size")
    if not args.ep_size:
        return None
    try:
        p2l = expert_parallel.load_placement_map(args.ep_placement) if args.ep_placement else None
    except expert_parallel.PlacementError as e:
        raise UsageError(f"--ep-placement: {e}") from None
    return expert_parallel.EPSpec(size=args.ep_size, physical_to_logical=p2l)
