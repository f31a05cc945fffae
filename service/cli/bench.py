"""`moespec bench SUITE`: each suite measures side by side in one run and prints figures.

    moespec bench engine      policies vs plain decoding vs transformers, verify cost, capture overhead
    moespec bench draft       the drafters through `moespec serve`: greedy and sampled requests, every draft
                              length x draft temperature, draft and verify cost in plain decode steps
    moespec bench server      gRPC overhead vs in-process, throughput and latency at concurrency 1/4/16/32,
                              policies x concurrency under continuous batching (cost per token, batch union)
    moespec bench step        a plain decode step through `moespec serve` and in-process: the verify pass against
                              the whole step (the work outside the forward)
    moespec bench telemetry   throughput with telemetry off / live receiver / unreachable endpoint
    moespec bench tuner       exhaustive policy grid vs the tuner's pick on the same workload
    moespec bench fleet       one tuner worker vs one per replica on a shared PostgreSQL study: wall time, pick
    moespec bench kernel-window  batched passes with the fused MoE kernel up to 16 positions vs every pass
    moespec bench threads     `moespec serve` over gRPC at each --threads count and at the measured default
    moespec bench whatif      what-if predictions of shorter draft lengths vs running them for real
    moespec bench sglang      the SGLang backend by policy beside the embedded engine (SGLang venv)
    moespec bench sglang-batching  the SGLang backend's batching gain beside SGLang alone's (SGLang venv)
    moespec bench sglang-switch  a draft-length change under load: prepared lengths against engine swaps (SGLang venv)
    moespec bench sglang-trees  EAGLE-3 draft trees against chains on the SGLang backend: acceptance, expert
                              unions (window and branch), tokens/s (SGLang venv)
    moespec bench adaptive    draft-length controllers (moespec's rule, SGLang's, transformers', Cascade's) vs
                              plain and the best static policy on a 1 / 16 client workload, interleaved
    moespec bench llamacpp    llama.cpp beside the embedded engine on the shipped checkpoints, interleaved
                              (scripts/setup_llama_cpp.sh builds it): decode, prefill, speculative, batched
    moespec bench verify-cost  cost(w, U) of verify windows on a real MoE geometry (presets or a HF config.json),
                              a fitted cost model, and the profile `moespec whatif --cost-profile` reads
"""

from __future__ import annotations

import argparse
import importlib

SUITES: dict[str, tuple[str, str]] = {
    "engine": ("service.bench.engine", "the embedded engine: every policy vs plain decoding and transformers"),
    "draft": ("service.bench.draft", "the drafters through moespec serve, greedy and sampled, interleaved"),
    "server": ("service.bench.server", "the gRPC server: overhead vs in-process, load at several concurrencies"),
    "step": ("service.bench.step", "plain decode: the verify pass against the whole step, served and in-process"),
    "telemetry": ("service.bench.telemetry", "throughput with telemetry off, on, and with an unreachable endpoint"),
    "tuner": ("service.bench.tuner", "exhaustive grid vs the tuner's pick"),
    "fleet": ("service.bench.fleet", "one tuner worker vs one per replica on one PostgreSQL study"),
    "kernel-window": ("service.bench.kernel_window", "batched passes: MoE kernel up to 16 positions vs every pass"),
    "threads": ("service.bench.threads", "moespec serve at each --threads count vs its measured default"),
    "whatif": ("service.bench.whatif", "what-if predictions of shorter draft lengths vs measured runs"),
    "sglang": ("service.bench.sglang", "the SGLang backend by policy, the embedded engine beside it"),
    "sglang-batching": ("service.bench.sglang_batching", "the SGLang backend's batching gain beside SGLang alone's"),
    "sglang-switch": ("service.bench.sglang_switch", "a draft-length change under load on the SGLang backend: "
                                                     "prepared lengths against engine swaps"),
    "sglang-trees": ("service.bench.sglang_trees", "EAGLE-3 draft trees against chains on the SGLang backend: "
                                                   "acceptance and expert unions"),
    "adaptive": ("service.bench.adaptive", "draft-length controllers vs static policies on a mixed workload"),
    "verify-cost": ("service.bench.verify_cost.command",
                    "cost of verify windows by size and expert union on a model geometry; a cost profile"),
    "llamacpp": ("service.bench.llama_cpp", "llama.cpp beside the embedded engine on the shipped checkpoints"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    sub = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name, (module, help_text) in SUITES.items():
        suite = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(suite)
        suite.set_defaults(_suite_module=module)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(args._suite_module).run(args)
