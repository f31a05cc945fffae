"""Limits before work: a request that can never fit the context is refused from its lengths alone,
the default receive limit is what a full context needs, and while several clients flood a real
`moespec serve` with oversized requests its health check and a small Generate stay fast."""

from __future__ import annotations

import statistics
import sys
import threading
import time
import unicodedata

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from service.engine.model.weights import DEFAULT_TARGET_DIR
from service.limits import NORMALIZER_SHRINK, PromptLimits, default_request_limit, tokenizer_prompt_bytes
from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from tuner.drivers.server_proc import start_server

CONTEXT = 512  # the shipped target's
FAST_START = ("--threads", "1", "--kernel-threads", "1", "--max-batch", "4")
GENERATE = "/moespec.v1.Inference/Generate"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEFAULT_TARGET_DIR / "tokenizer.json"))


# ------------------------------------------------------------------ the byte bound itself
def test_normalizer_shrink_factors_hold_for_every_code_point():
    """Independent recount: how many times fewer bytes each normal form can make of one character."""
    def nbytes(s: str) -> int:
        return len(s.encode("utf-8", "surrogatepass"))

    worst = dict.fromkeys(NORMALIZER_SHRINK, 1.0)
    for code in range(sys.maxunicode + 1):
        c = chr(code)
        if 0xD800 <= code <= 0xDFFF:
            continue
        nfd, nfkd = unicodedata.normalize("NFD", c), unicodedata.normalize("NFKD", c)
        nfc, nfkc = unicodedata.normalize("NFC", c), unicodedata.normalize("NFKC", c)
        worst["NFC"] = max(worst["NFC"], nbytes(nfd) / nbytes(nfc), nbytes(c) / nbytes(nfc))
        worst["NFD"] = max(worst["NFD"], nbytes(c) / nbytes(nfd))
        worst["NFKC"] = max(worst["NFKC"], nbytes(nfkd) / nbytes(nfkc), nbytes(c) / nbytes(nfkc))
        worst["NFKD"] = max(worst["NFKD"], nbytes(c) / nbytes(nfkd))
    for form, factor in worst.items():
        assert factor <= NORMALIZER_SHRINK[form], (form, factor)
    assert worst["NFC"] == 3  # a Hangul syllable from three jamo: the bound is tight


@pytest.mark.parametrize("text", [
    "def add(a, b):\n    return a + b\n" * 40,
    "\u1100\u1161\u11a8" * 400,  # decomposed Hangul: NFC makes one 3-byte syllable of 9 bytes
    "e\u0301\u0323" * 400,  # combining marks
    " " * 5000, "\n" * 5000, "a" * 5000, "\U0001d400" * 500, "\ufffd\x00\x7f" * 500,
], ids=["code", "jamo", "combining", "spaces", "newlines", "letters", "math-letters", "odd-bytes"])
def test_no_text_packs_more_bytes_per_token_than_the_bound_allows(tokenizer, text):
    bound = tokenizer_prompt_bytes(tokenizer, CONTEXT)
    per_token = bound / (CONTEXT - 1)
    tokens = len(tokenizer.encode(text).ids)
    assert len(text.encode("utf-8")) <= per_token * tokens


def test_the_shipped_tokenizer_gets_a_byte_bound_and_the_limit_is_what_a_full_context_needs(tokenizer):
    limits = PromptLimits(CONTEXT, tokenizer_prompt_bytes(tokenizer, CONTEXT), tokenizer.get_vocab_size())
    assert limits.max_prompt_bytes is not None and limits.max_prompt_bytes < 100_000
    assert 64 << 10 <= default_request_limit(limits) < (1 << 20) // 4  # far under the old 1 MiB


# ------------------------------------------------------------------ a real server under a flood
def raw_generate(channel: grpc.Channel):
    """Generate with pre-serialized request bytes: the flood costs the test process almost nothing."""
    return channel.unary_unary(GENERATE, request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)


def oversized_requests() -> dict[str, bytes]:
    return {
        "ids": pb.GenerateRequest(prompt_token_ids=[7] * 1_000_000, max_new_tokens=4).SerializeToString(),
        "text": pb.GenerateRequest(prompt="ab " * 350_000, max_new_tokens=4).SerializeToString(),  # ~1 MB
        "ids-over-context": pb.GenerateRequest(prompt_token_ids=[7] * 600, max_new_tokens=4).SerializeToString(),
        "text-over-bound": pb.GenerateRequest(prompt="x" * 60_000, max_new_tokens=4).SerializeToString(),
    }


@pytest.fixture(scope="module")
def default_server():
    with start_server({}, "t", FAST_START) as server:
        yield server


@pytest.fixture(scope="module")
def wide_open_server():
    """A receive limit as large as before (8 MiB): oversized messages reach the handler, so the length
    checks and the off-loop validation carry the whole load."""
    with start_server({}, "t", (*FAST_START, "--max-request-bytes", str(8 << 20), "--max-message-bytes",
                                str(8 << 20), "--max-queue", "64")) as server:
        yield server


def test_the_default_limits_refuse_each_kind_naming_the_problem(default_server):
    expected = {
        "ids": (grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
        "text": (grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
        "ids-over-context": (grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: 600 tokens; the context holds 512"),
        "text-over-bound": (grpc.StatusCode.INVALID_ARGUMENT, "prompt: 60000 bytes can never fit"),
    }
    with grpc.insecure_channel(default_server.address) as channel:
        call = raw_generate(channel)
        for kind, body in oversized_requests().items():
            with pytest.raises(grpc.RpcError) as e:
                call(body, timeout=30)
            code, text = expected[kind]
            assert e.value.code() == code and text in e.value.details(), (kind, e.value.details())


def test_health_and_a_small_generate_stay_fast_while_clients_flood_oversized_requests(wide_open_server):
    address = wide_open_server.address
    bodies = oversized_requests()
    outcomes: list[tuple[str, grpc.StatusCode, str, float]] = []
    stop = threading.Event()
    lock = threading.Lock()

    def flood(kinds: tuple[str, ...]) -> None:
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 16 << 20)]) as channel:
            call = raw_generate(channel)
            i = 0
            while not stop.is_set():
                kind = kinds[i % len(kinds)]
                i += 1
                t0 = time.perf_counter()
                try:
                    call(bodies[kind], timeout=30)
                    code, details = grpc.StatusCode.OK, ""
                except grpc.RpcError as e:
                    code, details = e.code(), e.details()
                with lock:
                    outcomes.append((kind, code, details, time.perf_counter() - t0))

    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        generate = raw_generate(channel)
        small = pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=8,
                                   sampling=pb.SamplingParams(temperature=0)).SerializeToString()

        def health_seconds() -> float:
            t0 = time.perf_counter()
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            return time.perf_counter() - t0

        quiet = [health_seconds() for _ in range(20)]
        t0 = time.perf_counter()
        generate(small, timeout=10)
        quiet_generate = time.perf_counter() - t0
        floods = [threading.Thread(target=flood, args=(("ids", "text"),), daemon=True) for _ in range(6)]
        for thread in floods:
            thread.start()
        try:
            time.sleep(1.0)  # let the flood build up
            loaded, generates = [], []
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:
                loaded.append(health_seconds())
                t0 = time.perf_counter()
                reply = generate(small, timeout=10)  # DEADLINE_EXCEEDED would fail the test
                generates.append(time.perf_counter() - t0)
                assert reply.completion_tokens >= 1
                time.sleep(0.05)
        finally:
            stop.set()
            for thread in floods:
                thread.join(60)
    print(f"\nhealth quiet median {statistics.median(quiet) * 1e3:.1f} ms; under flood median "
          f"{statistics.median(loaded) * 1e3:.1f} ms, max {max(loaded) * 1e3:.1f} ms ({len(loaded)} checks); "
          f"small generate quiet {quiet_generate:.3f} s, under flood median {statistics.median(generates):.3f} s, "
          f"max {max(generates):.3f} s; {len(outcomes)} oversized requests refused, median "
          f"{statistics.median(o[3] for o in outcomes) * 1e3:.1f} ms")
    assert len(outcomes) >= 12 and max(loaded) < 1.0 and max(generates) < 10
    # Refused from their lengths: each in well under a second even with six clients at it (copying
    # and checking the ids, or tokenizing the text, took seconds per request under this load).
    assert statistics.median(o[3] for o in outcomes) < 1.0
    for kind, code, details, _ in outcomes:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (kind, code, details)
        field = {"ids": "prompt_token_ids: 1000000 tokens", "text": "prompt: 1050000 bytes can never fit"}[kind]
        assert details.startswith(field), (kind, details)
