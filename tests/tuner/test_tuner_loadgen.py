"""The load generator's arrival models, stop conditions and summary, against a fake client."""

from __future__ import annotations

import argparse
import threading
import time

import grpc
import pytest

from service.cli.loadgen import add_arguments, spec_from_args
from service.errors import UsageError
from service.server.client import Reply
from service.types import FinishReason
from tests.support.tuner_fixtures import FakeRpcError
from tuner.drivers.loadgen import DEFAULT_PROMPTS, LoadGenerator, LoadSpec, LoadSummary, first_prompts, load_prompts


class FakeClient:
    def __init__(self, delay: float = 0.0, fail_every: int = 0):
        self.delay, self.fail_every = delay, fail_every
        self.lock = threading.Lock()
        self.requests = []
        self.in_flight = self.max_in_flight = 0

    def generate(self, request, timeout=None) -> Reply:
        with self.lock:
            self.requests.append(request)
            n = len(self.requests)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        time.sleep(self.delay)
        with self.lock:
            self.in_flight -= 1
        if self.fail_every and n % self.fail_every == 0:
            raise FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)
        return Reply("x", (1,) * request.max_new_tokens, FinishReason.LENGTH, 10, request.max_new_tokens, "", None,
                     0.0, 0.0)


PROMPTS = ["a", "b", "c"]


def test_count_bound_closed_loop_sends_exactly_count_with_bounded_concurrency():
    client = FakeClient(delay=0.01)
    summary = LoadGenerator(client, PROMPTS, LoadSpec(concurrency=3, count=10, max_new_tokens=5)).run()
    assert summary.ok == 10 and len(client.requests) == 10
    assert client.max_in_flight <= 3
    assert [r.prompt for r in client.requests[:3]] == PROMPTS  # the prompt set in order, cycled
    assert summary.output_tokens == 50 and summary.prompt_tokens == 100


def test_duration_bound_run_stops_in_time():
    client = FakeClient(delay=0.005)
    t0 = time.monotonic()
    summary = LoadGenerator(client, PROMPTS, LoadSpec(concurrency=2, duration=0.3)).run()
    assert 0.25 < time.monotonic() - t0 < 1.5 and summary.ok > 5


def test_open_loop_rate_is_roughly_kept_and_errors_are_counted_not_retried():
    client = FakeClient(fail_every=4)
    summary = LoadGenerator(client, PROMPTS, LoadSpec(concurrency=None, rate=200, count=40, seed=1)).run()
    assert summary.ok == 30 and summary.errors == {"RESOURCE_EXHAUSTED": 10}
    assert 0.05 < summary.seconds < 1.0  # 40 arrivals at 200/s: ~0.2 s


def test_stop_event_ends_an_unbounded_run():
    client = FakeClient(delay=0.005)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert LoadGenerator(client, PROMPTS, LoadSpec(concurrency=1)).run(stop).ok > 0


def test_percentiles_are_nearest_rank():
    s = LoadSummary(latencies=[float(i) for i in range(1, 101)])
    assert (s.percentile(50), s.percentile(99)) == (50.0, 99.0)
    assert s.as_dict()["latency_p50_seconds"] == 50.0


def test_shipped_prompts_load_and_bad_files_are_usage_errors(tmp_path):
    assert len(load_prompts(DEFAULT_PROMPTS)) >= 32
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(UsageError, match="p.jsonl:1"):
        load_prompts(bad)
    with pytest.raises(UsageError, match="cannot read"):
        load_prompts(tmp_path / "missing.txt")


def test_prompt_subset_is_the_first_n_and_checked():
    assert first_prompts(PROMPTS, 2) == ["a", "b"] and first_prompts(PROMPTS, None) == PROMPTS
    with pytest.raises(UsageError, match="prompt-count"):
        first_prompts(PROMPTS, 4)


def test_sampled_requests_carry_temperature_top_p_and_a_seed_each():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = spec_from_args(parser.parse_args(["--count", "4", "--temperature", "0.8", "--top-p", "0.9",
                                             "--seed", "7", "--concurrency", "1"]))
    client = FakeClient()
    LoadGenerator(client, PROMPTS, spec).run()
    assert [(r.sampling.temperature, r.sampling.top_p) for r in client.requests] == [(0.8, 0.9)] * 4
    assert sorted(r.sampling.seed for r in client.requests) == [7, 8, 9, 10]


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--rate", "-1"], ["--count", "0"], ["--duration", "0"],
                                  ["--top-p", "0"], ["--top-p", "1.5"]])
def test_bad_arguments_are_usage_errors(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UsageError):
        spec_from_args(parser.parse_args(argv))


def test_default_is_two_callers_for_thirty_seconds():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = spec_from_args(parser.parse_args([]))
    assert (spec.concurrency, spec.rate, spec.duration, spec.count) == (2, None, 30.0, None)
