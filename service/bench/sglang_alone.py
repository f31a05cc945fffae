"""SGLang alone: a bare `sglang.Engine` with the SGLang backend's own engine arguments, as the yardstick
the backend is measured against (its batching gain, its greedy outputs), run as its own process.

    python -m service.bench.sglang_alone --prompts FILE [--max-new-tokens 32] [--rounds 1]
        [--batch-sizes 8 16] [--tap] [serve's sglang options: --device cpu --model-path DIR ...]

Per round: the prompts one after another (each `Engine.generate` waits for the last), then all of
them at once in one batch call, greedy, and a batch call of the first B prompts for each of
--batch-sizes. Prints one JSON line: outputs and wall times of each, and the engine's start-up
seconds. The engine arguments are `service.sglang_backend.cli.base_kwargs` of the same options, so
only moespec's layer differs from what `moespec serve --backend sglang` runs.

With --tap the moespec plugin is switched on for this engine (a StatsChannel bound here) and the
JSON carries the number of pass records received; without it the plugin must stay inert, and SGLang's
own log (stderr) says so: the plugin loads, registers nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from service.sglang_backend import cli as sglang_cli
    from service.sglang_backend import device as devices
    from service.sglang_backend.sampling import sampling_params
    from service.types import GenerationRequest

    parser = argparse.ArgumentParser(prog="sglang_alone", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of prompt token-id lists")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[])
    parser.add_argument("--tap", action="store_true", help="switch the moespec plugin on for this engine")
    sglang_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    prompts = json.loads(args.prompts.read_text())
    os.environ.update(devices.environment(args.device, dict(os.environ)))
    kwargs = sglang_cli.base_kwargs(args)
    kwargs["log_level"] = "info"  # the plugin framework's own lines show what the plugin did
    channel = None
    if args.tap:
        from service.sglang_backend.stats_channel import StatsChannel
        from service.sglang_plugin.wire import TAP_ENV

        channel = StatsChannel()
        os.environ[TAP_ENV] = channel.config(capture_topk=False).to_env()
        channel.register("sglang-alone")  # nothing is sent under this rid: records are counted below
    import sglang

    t0 = time.perf_counter()
    engine = sglang.Engine(**kwargs)
    started = time.perf_counter() - t0
    # What the backend sends SGLang for a greedy request of this length (service/sglang_backend/sampling.py).
    params = sampling_params(GenerationRequest(prompt_token_ids=(1,), max_new_tokens=args.max_new_tokens),
                             greedy=True)
    rounds = []
    try:
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            sequential = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
            sequential_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            batch = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
            batch_s = time.perf_counter() - t0
            sized = {}
            for size in args.batch_sizes:
                t0 = time.perf_counter()
                outputs = [r["output_ids"] for r in engine.generate(input_ids=prompts[:size], sampling_params=params)]
                sized[str(size)] = {"seconds": time.perf_counter() - t0, "tokens": sum(map(len, outputs))}
            rounds.append({"sequential": sequential, "sequential_s": sequential_s, "batch": batch,
                           "batch_s": batch_s, "batch_sizes": sized})
    finally:
        engine.shutdown()
    out = {"start_s": started, "rounds": rounds}
    if channel is not None:
        out["passes_received"] = channel.passes_received
        channel.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
