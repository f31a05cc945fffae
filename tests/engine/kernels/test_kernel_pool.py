"""A pass split over the kernels' worker pool is bitwise the one-thread pass; the pool serves one caller
at a time, survives workers the OS keeps waiting and a fork, and splits only passes past each kernel's
minimum."""

from __future__ import annotations

import time

import pytest
import torch

from service.engine.kernels import library as kernels
from service.engine.kernels.packed import PackedWeight, panel_format
from tests.support.kernel_cases import H, M, window


@pytest.mark.parametrize("math", ["fp32", "bf16", "amx"])
@pytest.mark.parametrize("w", [1, 2, 5, 16, 17, 70])
def test_splitting_a_pass_over_threads_changes_no_bit(k, block_weights, pool, w, math):
    """The MoE block split over a pool's threads (by expert up to 16 positions, by position past that)
    and the output layer's columns split give bitwise the one-thread result, also with more threads than
    positions, experts or panels; and each position's row is bitwise its row alone, in either arithmetic."""
    if math == "amx" and not k.amx_native:
        pytest.skip("no AMX tile unit on this CPU or kernel")
    bw = block_weights
    block = kernels.MoeBlock(bw["router_and_gate"], M, False, bw["gate_up"], bw["down"], bw["shared_gate"],
                             bw["shared_up"], bw["shared_down"], math=math)
    x, _, _ = window(w, seed=15)
    alone = k.moe_block(block, x)
    for got, want in zip(k.moe_block(block, x, pool), alone, strict=True):
        assert torch.equal(got, want)
    for p in {0, w - 1}:
        assert torch.equal(k.moe_block(block, x[p:p + 1])[0][0], alone[0][p])
    weight = PackedWeight.pack(torch.randn(200, H, generator=torch.Generator().manual_seed(16)),
                               panel_format(math, torch.zeros(1, H)) if math != "fp32" else None)  # 4 panels
    assert torch.equal(k.linear(x[:10], weight, pool), k.linear(x[:10], weight))
    assert torch.equal(k.linear(x[:1], weight)[0], k.linear(x[:10], weight)[0])


def test_a_pool_serves_one_caller_at_a_time_and_runs_alone_once_closed(k, block_weights):
    """Two threads calling one pool at once both get the right rows (the second runs its call alone);
    a closed pool's calls run on the calling thread."""
    from concurrent.futures import ThreadPoolExecutor

    bw = block_weights
    block = kernels.MoeBlock(bw["router_and_gate"], M, True, bw["gate_up"], bw["down"], bw["shared_gate"],
                             bw["shared_up"], bw["shared_down"])
    inputs = [window(64, seed=s)[0] for s in range(8)]
    want = [k.moe_block(block, x)[0] for x in inputs]
    shared = k.pool(2)
    with ThreadPoolExecutor(4) as callers:
        for _ in range(5):
            got = list(callers.map(lambda x: k.moe_block(block, x, shared)[0], inputs))
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    shared.close()
    assert shared.handle is None and torch.equal(k.moe_block(block, inputs[0], shared)[0], want[0])


def test_a_pool_whose_workers_the_os_keeps_waiting_still_gives_every_call_bitwise_its_result(k, block_weights):
    """Two busy processes hold this machine's cores, so the OS often runs the caller while a worker waits
    for a core (or the reverse): ranges are claimed by whoever runs, and the caller waits only for ranges
    another thread claimed. 400 calls of random sizes (by expert and by position) must each come out
    bitwise the one-thread result, and none may hang."""
    import subprocess
    import sys

    bw = block_weights
    block = kernels.MoeBlock(bw["router_and_gate"], M, False, bw["gate_up"], bw["down"], bw["shared_gate"],
                             bw["shared_up"], bw["shared_down"])
    g = torch.Generator().manual_seed(19)
    inputs = [window(int(torch.randint(1, 70, (1,), generator=g)), seed=100 + i)[0] for i in range(40)]
    want = [k.moe_block(block, x)[0] for x in inputs]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    started = k.pool(2)
    try:
        for i in range(400):
            assert torch.equal(k.moe_block(block, inputs[i % 40], started)[0], want[i % 40])
    finally:
        started.close()
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_forked_child_runs_its_calls_alone_instead_of_waiting_for_workers_it_does_not_have(k, block_weights):
    import os

    bw = block_weights
    block = kernels.MoeBlock(bw["router_and_gate"], M, False, bw["gate_up"], bw["down"], bw["shared_gate"],
                             bw["shared_up"], bw["shared_down"])
    x, _, _ = window(40, seed=18)
    want = k.moe_block(block, x)[0]
    started = k.pool(2)
    child = os.fork()
    if child == 0:  # the child: exit 0 only if the call returns the right rows
        os._exit(0 if torch.equal(k.moe_block(block, x, started)[0], want) else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(child, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if done == (0, 0):
        os.kill(child, 9)
        os.waitpid(child, 0)
    started.close()
    assert done != (0, 0), "the forked child hung waiting for the pool's workers"
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_kernel_threads_split_only_passes_past_each_kernels_minimum(k):
    started = k.pool(4)
    split = kernels.KernelThreads(started, moe_min_positions=4, linear_min_positions=8, attention_min_positions=32)
    assert split.threads == 4
    assert [split.moe(n) for n in (1, 3, 4, 100)] == [None, None, started, started]
    assert [split.linear(n) for n in (7, 8)] == [None, started]
    assert [split.attention(n) for n in (31, 32)] == [None, started]
    assert "from 4 positions in the MoE block, 8 in the output layer, 32 in attention" in split.describe()
    assert kernels.ONE_THREAD.moe(1000) is None and "no pass is split" in kernels.ONE_THREAD.describe()
    started.close()
    with pytest.raises(ValueError, match="kernel threads must be an int >= 1, got 0"):
        k.pool(0)
