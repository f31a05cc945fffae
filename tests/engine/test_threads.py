"""The thread default: the candidates, the choice following real measurements
(the fastest count wins, the fewest threads among near-equals), the server's measurement times real
decode steps at the count it sets, and `moespec serve` without --threads says what it picked."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from service.engine import threads
from service.engine.kernels.library import build as build_kernels
from service.engine.kernels.library import choose_math


@pytest.fixture
def restore_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def busy(n: int) -> float:
    """CPU seconds of real work proportional to n (the workloads below, not a stub); CPU time, so
    other tenants of a shared machine preempting this thread do not reorder the candidates."""
    t0 = time.thread_time()
    total = 0
    for i in range(n):
        total += i * i
    return time.thread_time() - t0


@pytest.mark.parametrize("cores, expected", [(1, (1,)), (2, (1, 2)), (3, (1, 2, 3)), (4, (1, 2, 4)),
                                             (16, (1, 2, 4, 8, 16))])
def test_candidates_are_powers_of_two_and_all_cores(cores, expected):
    assert threads.candidates(cores) == expected


def test_on_one_core_there_is_nothing_to_measure():
    choice = threads.choose(1, measure=lambda t: pytest.fail("measured with a single candidate"))
    assert choice.threads == 1 and choice.seconds == {} and "nothing to measure" in choice.describe()


def test_the_fastest_measured_count_wins():
    # Work that shrinks with the thread count (as a parallel step would): 8 threads is clearly fastest.
    choice = threads.choose(8, measure=lambda t: busy(400_000 // t))
    assert choice.candidates == (1, 2, 4, 8)
    assert choice.threads == 8, choice.seconds
    # Work that grows with it (threads fighting over cores): 1 wins.
    assert threads.choose(8, measure=lambda t: busy(50_000 * t)).threads == 1


def test_the_server_keeps_a_core_for_its_own_threads(engine, restore_torch_threads):
    choice = threads.pick_threads(engine.target, cores=2)  # one candidate left: nothing is timed
    assert choice.threads == 1 and choice.candidates == (1,) and choice.reserved == 1
    assert torch.get_num_threads() == 1
    assert "2 usable cores, 1 kept for the server's own threads" in choice.describe()
    timed = threads.choose(16, measure=lambda t: busy(400_000 // t), reserved=1)
    assert timed.candidates == (1, 2, 4, 8, 15) and timed.threads == 15
    assert threads.choose(1, measure=lambda t: pytest.fail("nothing to measure"), reserved=1).threads == 1


def test_near_equal_counts_go_to_the_fewest_threads():
    choice = threads.choose(8, measure=lambda t: busy(100_000), tolerance=1.0)
    assert choice.threads == 1
    assert set(choice.seconds) == {1, 2, 4, 8}


def test_a_hopeless_candidate_is_measured_once():
    calls: list[int] = []

    def measure(t: int) -> float:
        calls.append(t)
        return busy(20_000 * (10 if t == 4 else 1))

    choice = threads.choose(4, measure=measure)
    assert calls.count(4) == 1 and calls.count(1) == 3 and choice.threads != 4


def test_the_request_timer_runs_the_model_at_the_count_it_is_given(engine, restore_torch_threads):
    measure = threads.request_timer(engine.target, steps=4, prompt_tokens=8)
    seconds = measure(2)
    assert torch.get_num_threads() == 2
    assert 0 < seconds < 30.0
    # Picking for three cores keeps one for the server's threads, times 1 and 2 with the real model
    # and applies the pick.
    choice = threads.pick_threads(engine.target, cores=3)
    assert choice.candidates == (1, 2) and set(choice.seconds) == {1, 2}
    assert torch.get_num_threads() == choice.threads
    assert choice.seconds[choice.threads] <= min(choice.seconds.values()) * 1.05
    assert "short request" in choice.describe()


def test_serve_without_threads_prints_its_pick_and_serves():
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("moespec serving on "), line
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    match = re.search(r"torch intra-op threads: (\d+) \((\d+) usable cores", err)
    assert match, err
    picked, cores = int(match.group(1)), int(match.group(2))
    assert cores == threads.usable_cores() and picked in threads.candidates(cores)
    # The kernels split big passes over every usable core by default, and it says so.
    assert re.search(rf"kernel threads: {cores} \(|kernel threads: 1 \(no pass is split\)", err), err
    # AMX where the CPU says (its own flags, read here) it has the tiles; else bf16 exactly where it has
    # the bf16 pair instruction and that instruction measures faster than float32 FMAs.
    flags = set(Path("/proc/cpuinfo").read_text().split())
    speedup = build_kernels().bf16_dot_speedup() if "avx512_bf16" in flags else 0.0
    expected = "amx" if {"amx_tile", "amx_bf16"} <= flags else choose_math(False, speedup)
    assert f"matrix products in {expected} (" in err, err


def test_an_unknown_math_is_refused_naming_it():
    done = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--port", "0", "--math", "fp16"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--math" in done.stderr and "'fp16'" in done.stderr, done.stderr
    from service.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match="math must be one of .* got 'fp16'"):
        Engine(EngineConfig(math="fp16"))


def test_kernel_threads_below_one_exit_2_naming_the_flag():
    done = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--port", "0", "--kernel-threads", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--kernel-threads must be >= 1, got 0" in done.stderr, done.stderr
