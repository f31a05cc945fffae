"""GPU check of the SGLang plugin's statistics under CUDA graphs (torch only: no SGLang needed).

    python scripts/gpu_check_tap.py [--out FILE.json]

SGLang captures its decode and verify passes as CUDA graphs and replays them; the plugin's routing
ops run while a graph is captured and must then produce, on every replay, what they produce eagerly.
This captures `on_routed` for every layer of a pass into one graph (begin and finish stay eager, as in
the scheduler), replays it on fresh routed ids, and compares with an eager run over the same ids, for
several batch shapes. Prints one line per shape and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from service.sglang_plugin.statistics import PassStatistics  # noqa: E402

LAYERS, EXPERTS, TOP_K = 48, 128, 8  # a Qwen3-30B-A3B-like geometry


def routed(batch: int, width: int, generator: torch.Generator) -> torch.Tensor:
    scores = torch.rand(LAYERS, batch * width, EXPERTS, device="cuda", generator=generator)
    return scores.topk(TOP_K, dim=-1).indices.to(torch.int32)  # [L, n, m] distinct ids per token


def check(batch: int, width: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(batch * 100 + width)
    n = batch * width
    graphed = PassStatistics(LAYERS, EXPERTS, None, torch.device("cuda"), capture_topk=True)
    eager = PassStatistics(LAYERS, EXPERTS, None, torch.device("cuda"), capture_topk=True)
    graphed.ensure_capacity(n)
    static_ids = routed(batch, width, generator)  # the graph's input buffer, as SGLang's topk output is
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture, as torch asks
        graphed.begin(n)
        for layer in range(LAYERS):
            graphed.on_routed(layer, static_ids[layer])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            graphed.on_routed(layer, static_ids[layer])
    mismatches = 0
    for _ in range(5):
        ids = routed(batch, width, generator)
        static_ids.copy_(ids)
        graphed.begin(n)  # eager, before the replay
        graph.replay()
        got = graphed.finish(batch, width)
        eager.begin(n)
        for layer in range(LAYERS):
            eager.on_routed(layer, ids[layer])
        want = eager.finish(batch, width)
        torch.cuda.synchronize()
        mismatches += sum(not torch.equal(got[k], want[k]) for k in want)
    return {"batch": batch, "width": width, "mismatches": mismatches}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA GPU")
        return 0
    rows = [check(b, w) for b, w in ((1, 1), (32, 1), (1, 4), (32, 4), (64, 8))]
    for row in rows:
        print(f"batch {row['batch']:3d} x window {row['width']}: {row['mismatches']} mismatching outputs")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return 1 if any(r["mismatches"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
