"""The fastest a plain decode step could run on this machine, measured in the same run.

A step must read every weight its token touches and do the multiply-adds with them. At the shipped
model's size (its target's weights are a few MB in bf16) the weights stay in the CPU's caches from
one step to the next, so DRAM bandwidth bounds nothing: what bounds a step is how fast the cores
read a cache-resident buffer of the step's size, and how fast they retire fused multiply-adds. Both
are measured here (`measure_rates`), by the machine probes (service/engine/kernels/probe.py: built with
the kernels' compiler flags, split over the same pool code on as many threads), on a buffer of exactly
the step's weight bytes (so it sits in whichever cache level the weights do). The limit is
1 / max(bytes / read rate, flops / FMA rate): a step that did nothing but read its weights once, or
nothing but its arithmetic at peak. Anything real (attention over the KV cache, activations, the
work between kernels) only adds, so a measured engine's share of the limit is below 1; each rate is
the fastest of its samples, so other load on the machine can lower a share, never lift it past 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from service.engine.kernels import probe
from service.engine.kernels.packed import F32, PAIRED
from service.engine.kernels.pool import KernelPool

FLOAT32 = 4
SAMPLES = 5
SAMPLE_SECONDS = 0.02


@dataclass(frozen=True)
class StepCost:
    weight_bytes: int  # weights a one-position step reads, in the layout the kernels read them
    flops: int  # 2 per multiply-add of its matrix products and attention

    def limit_tokens_per_second(self, rates: MachineRates, bf16_math: bool = False) -> float:
        """bf16_math: the products run as bf16 dot products (VDPBF16PS), two multiply-adds per lane
        per instruction where a float32 FMA does one: twice the probe's flop rate."""
        flops_per_second = rates.flops_per_second * (2 if bf16_math else 1)
        return 1.0 / max(self.weight_bytes / rates.read_bytes_per_second, self.flops / flops_per_second)


@dataclass(frozen=True)
class MachineRates:
    read_bytes_per_second: float
    flops_per_second: float


def decode_step_cost(cfg, panel_bytes: float, context: int) -> StepCost:
    """One plain decode step of a Qwen2-MoE config at `context` keys: its matrices at `panel_bytes`
    per weight (2 for bf16 panels, 4 for float32), what stays float32 (router, biases, norms, the
    embedding row) at 4."""
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    A, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attention = H * (A + 2 * K) * D + A * D * H  # q/k/v, o
    attention_small = (A + 2 * K) * D + H  # biases, input norm
    if cfg.is_moe:
        m, I, Is, E = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, \
            cfg.num_experts
        ffn, ffn_small = m * 3 * H * I + 3 * H * Is, (E + 1) * H + H  # experts; router + shared gate, norm
    else:
        ffn, ffn_small = 3 * H * cfg.intermediate_size, H
    matrices = L * (attention + ffn) + V * H  # the layers and the output layer
    small = L * (attention_small + ffn_small) + 2 * H  # the embedding row and the final norm too
    attend = L * 2 * A * D * context  # q.k and the weighted sum of values, per head and key
    return StepCost(weight_bytes=int(matrices * panel_bytes + small * FLOAT32),
                    flops=2 * (matrices + L * ffn_small + attend))


def fused_step_cost(model, context: int) -> tuple[StepCost, bool]:
    """A fused model's (Transformer.fuse_for_inference with kernels) decode step at `context` keys, at
    the bytes of the panels its kernels read, and whether its products run in bf16 arithmetic."""
    fmt = model.lm_head_packed.format  # one math for every packed weight of the model
    return decode_step_cost(model.cfg, FLOAT32 if fmt == F32 else 2, context), fmt in PAIRED


def measure_rates(working_set_bytes: int, threads: int = 1) -> MachineRates:
    """This machine's cache-resident read rate over a buffer of `working_set_bytes` and its FMA rate,
    on `threads` threads (the engine's kernel threads): the fastest of SAMPLES timed runs each."""
    probes = probe.build()
    pool = probes.pool(threads) if threads > 1 else None
    try:
        return _rates(probes, working_set_bytes, pool)
    finally:
        if pool is not None:
            pool.close()


def _rates(probes: probe.Probes, working_set_bytes: int, pool: KernelPool | None) -> MachineRates:
    buf = torch.ones(max(working_set_bytes // (FLOAT32 * 128), 1) * 128)  # whole blocks: every float is read
    probes.read(buf, 2, pool)  # into the caches
    reads = max(1, int(SAMPLE_SECONDS * 50e9 / buf.nbytes))  # ~SAMPLE_SECONDS at 50 GB/s
    read_rate = max(buf.nbytes * reads / _timed(lambda: probes.read(buf, reads, pool))
                    for _ in range(SAMPLES))
    rounds = max(1, int(SAMPLE_SECONDS * 1e11 / (2 * probe.LANES * probe.FMA_CHAINS)))  # ~SAMPLE_SECONDS at 100 GFLOP/s
    flops = probes.fma(rounds, pool)
    fma_rate = max(flops / _timed(lambda: probes.fma(rounds, pool)) for _ in range(SAMPLES))
    return MachineRates(read_rate, fma_rate)


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start
