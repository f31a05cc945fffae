"""`moespec serve`: the gRPC Inference and PolicyAdmin services on the chosen backend.

Telemetry follows the standard OTEL_* variables (and the --otel-* flags that override them; see
otel.cli); it is off unless an exporter or endpoint is configured.

Prints one machine-readable line once the server accepts requests:
    moespec serving on HOST:PORT
(the real port when --port 0), so scripts and tests can parse where to connect.
Environment is read here, at run time, and passed down explicitly: MOESPEC_ADMIN_TOKEN, OTEL_*.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from otel import cli as otel_cli
from service.backend import Backend
from service.cli.generate import add_controller_arguments, cells_from_args
from service.engine_defaults import MAX_BATCH, PREFILL_CHUNK, STEPS_PER_CALL
from service.errors import UsageError
from service.security import admin_token
from service.server.server import MoespecServer, ServerConfig, serve
from service.types import Controller, Drafter, DraftPolicy, InvalidRequest

ADMIN_TOKEN_ENV = admin_token.ADMIN_TOKEN_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    parser.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one (printed)")
    parser.add_argument("--backend", choices=("torch", "sglang"), default="torch",
                        help="torch: the embedded engine on the shipped model, CPU only (its C kernels are built for "
                             "this machine's CPU); sglang: real SGLang on GPUs (--device cpu: on a CPU, for tests)")
    parser.add_argument("--workers", type=int, default=None,
                        help="requests running at once (default: the backend's batch slots, "
                             "the torch engine's --max-batch)")
    parser.add_argument("--max-queue", type=int, default=16,
                        help="generations that may wait for a worker; beyond that RESOURCE_EXHAUSTED")
    admin_token.add_arguments(parser, "PolicyAdmin requires (without one SetPolicy is refused)")
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain; with --tls-key serves TLS only")
    parser.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    parser.add_argument("--max-message-bytes", type=int, default=1 << 20,
                        help="largest response message; also caps the default --max-request-bytes (default 1 MiB)")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="largest request message; larger ones get RESOURCE_EXHAUSTED before any work "
                             "(default: twice what a full context needs, e.g. ~110 KB for the shipped model)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds in-flight requests get to finish after SIGTERM")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (torch backend); default: the fastest of 1, 2, 4, ... and all "
                             "cores, measured at start-up, and printed")
    parser.add_argument("--kernel-threads", type=int, default=None,
                        help="torch backend: threads the fused kernels split a big pass over (prefills, batched "
                             "steps); default: every usable core, printed")
    parser.add_argument("--math", choices=("fp32", "bf16", "amx"), default=None,
                        help="torch backend: the fused kernels' matrix products in float32, or with inputs rounded "
                             "to bf16 and float32 sums (faster prefills and batched steps where the CPU has "
                             "AVX512-BF16; docs/engine.md says what it costs in accuracy), or the same on the AMX "
                             "tile unit (Intel Xeons with AMX: faster still); default: amx where the CPU and "
                             "kernel offer it, else bf16 where the CPU's bf16 products run markedly faster than "
                             "float32's (measured at start-up), else fp32, printed")
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH,
                        help="torch backend: requests verified together in one pass (KV-cache slots); "
                             "default %(default)s")
    parser.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                        help="torch backend: newcomers' prompt tokens per pass while others decode (chunked "
                             "prefill: bounds how long a long prompt stalls the running requests); default "
                             "%(default)s")
    parser.add_argument("--steps-per-call", type=int, default=STEPS_PER_CALL,
                        help="torch backend: greedy steps one kernel call may run back to back while nobody "
                             "waits to join: plain steps, and a lone request's draft-head chain at draft "
                             "temperature 0 (the Python around a step then runs once per call; a newcomer, a "
                             "cancellation or a deadline waits up to that many steps); 1: one step per call; "
                             "default %(default)s")
    parser.add_argument("--draft-model", type=Path, default=None,
                        help="torch backend: the model drafter's weights, a draft head directory (default: the "
                             "shipped service/models/draft-head), an EAGLE-3 draft in SGLang's format "
                             "(service/models/eagle3) or a dense draft model directory "
                             "(service/models/draft, the one SGLang's STANDALONE mode loads)")
    parser.add_argument("--drafter", choices=[d.value for d in Drafter], default=Drafter.MODEL.value,
                        help="initial draft policy: drafter")
    parser.add_argument("--draft-length", type=int, default=0,
                        help="initial draft policy: tokens drafted per step (0 = no speculation)")
    parser.add_argument("--draft-temperature", type=float, default=1.0,
                        help="initial draft policy: draft sampling temperature (model drafter)")
    add_controller_arguments(parser, prefix="initial draft policy: ")
    parser.add_argument("--ep-size", type=int, default=0,
                        help="expert-parallel view of each verify pass over P ranks (spans gain moespec.moe.ep_*; "
                             "torch: estimated from its routing, sglang: from the recorder's physical "
                             "expert slots); 0 = off")
    parser.add_argument("--ep-placement", type=Path, default=None,
                        help="expert-to-rank placement: a physical-to-logical map [layers, slots] in SGLang's "
                             "shape (.pt or .json); default: contiguous blocks of experts per rank")
    parser.add_argument("--record-steps", type=Path, default=None,
                        help="append every request's steps (routed top-k ids, acceptance, times) to FILE "
                             "for `moespec whatif`")
    parser.add_argument("--instance-id", default=None,
                        help="this replica's identity, reported in GetModelInfo and as the service.instance.id "
                             "resource attribute a fleet tuner scopes its spans by (default: service.instance.id "
                             "from OTEL_RESOURCE_ATTRIBUTES, else a fresh random id per start, printed)")
    parser.add_argument("--log-level", default="WARNING", help="python logging level")
    otel_cli.add_arguments(parser)
    sglang = _sglang_module()
    if sglang is not None:  # its options all have defaults and are checked only by create_backend
        sglang.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = server_config(args, os.environ)
    telemetry_config = otel_cli.config_from_args(args, os.environ)  # bad OTEL_* / flags: exit 2 before loading
    instance = instance_id(args.instance_id, dict(telemetry_config.resource_attributes))
    config = replace(config, instance_id=instance)
    backend = create_backend(args)
    print(f"moespec instance id {instance}", file=sys.stderr, flush=True)
    try:
        telemetry = otel_cli.build_telemetry(args, os.environ, replace(backend.info, instance_id=instance))
        try:
            asyncio.run(serve(backend, config, telemetry, interceptors=telemetry.server_interceptors(),
                              on_ready=_announce))
        except InvalidRequest as e:  # the initial policy against what the backend offers (its tree width, ...)
            raise UsageError(f"initial draft policy: {e}") from None
        finally:
            telemetry.shutdown()  # flushes what is still buffered
    finally:
        backend.close()
    return 0


def instance_id(flag: str | None, resource: dict[str, str]) -> str:
    """--instance-id, else OTEL_RESOURCE_ATTRIBUTES' service.instance.id, else a fresh UUID: a
    restarted replica without a configured id is a new instance (its spans are a new stream)."""
    chosen = flag if flag is not None else resource.get("service.instance.id")
    if chosen is not None and not chosen.strip():
        raise UsageError("--instance-id must not be empty")
    return chosen.strip() if chosen is not None else str(uuid.uuid4())


def server_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerConfig:
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_batch < 1:
        raise UsageError("--max-batch must be >= 1")
    if args.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if args.steps_per_call < 1:
        raise UsageError(f"--steps-per-call must be >= 1, got {args.steps_per_call}")
    if (args.workers is not None and args.workers < 1) or args.max_queue < 0:
        raise UsageError("--workers must be >= 1 and --max-queue >= 0")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.kernel_threads is not None and args.kernel_threads < 1:
        raise UsageError(f"--kernel-threads must be >= 1, got {args.kernel_threads}")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.max_message_bytes < 1024:
        raise UsageError("--max-message-bytes must be at least 1024")
    if args.max_request_bytes is not None and args.max_request_bytes < 1024:
        raise UsageError("--max-request-bytes must be at least 1024")
    policy = DraftPolicy(Drafter(args.drafter), args.draft_length, args.draft_temperature, policy_id="default",
                         controller=Controller(args.controller), cost_weight=args.cost_weight,
                         cells=cells_from_args(args), tree_width=args.tree_width)
    try:
        policy.validate()
    except InvalidRequest as e:
        raise UsageError(f"initial draft policy: {e}") from None
    return ServerConfig(
        host=args.host,
        port=args.port,
        workers=args.workers,
        max_queue=args.max_queue,
        admin_token=admin_token.resolve(args, environ),
        tls_cert=_read(args.tls_cert),
        tls_key=_read(args.tls_key),
        max_message_bytes=args.max_message_bytes,
        max_request_bytes=args.max_request_bytes,
        grace_seconds=args.grace,
        initial_policy=policy,
    )


def create_backend(args: argparse.Namespace) -> Backend:
    if args.backend == "sglang":
        sglang = _sglang_module()
        if sglang is None:
            raise UsageError("the sglang backend is not part of this installation")
        return sglang.create_backend(args)
    # imported here: torch loads only when serving with it
    from service.engine import Engine, EngineConfig, MathUnavailable
    from service.engine.threads import default_threads
    from service.routing import expert_parallel
    from service.routing.expert_parallel_args import ep_spec

    ep = ep_spec(args)
    if args.record_steps is not None and not args.record_steps.resolve().parent.is_dir():
        raise UsageError(f"--record-steps: no folder {args.record_steps.resolve().parent}")
    if args.record_steps is not None:
        from service.security.private_files import create_private

        try:  # before the model loads: a symlink or another user's file exits 2 at once
            create_private(args.record_steps)
        except OSError as e:
            raise UsageError(f"--record-steps: {e}") from None
    draft = {} if args.draft_model is None else {"draft_dir": args.draft_model}
    if args.draft_model is not None and not args.draft_model.is_dir():
        raise UsageError(f"--draft-model: no folder {args.draft_model}")
    try:
        engine = Engine(EngineConfig(threads=args.threads or default_threads(), kernel_threads=args.kernel_threads,
                                     ep=ep, record_steps=args.record_steps, max_batch=args.max_batch,
                                     prefill_chunk=args.prefill_chunk, steps_per_call=args.steps_per_call,
                                     math=args.math, **draft))
    except expert_parallel.PlacementError as e:  # a placement that does not fit the model
        raise UsageError(f"--ep-placement: {e}") from None
    except MathUnavailable as e:
        raise UsageError(f"--math: {e}") from None
    except (FileNotFoundError, ValueError) as e:
        if args.draft_model is None:
            raise
        raise UsageError(f"--draft-model: {e}") from None
    if engine.step_kind == "fast":
        print(f"moespec: {engine.kernel_threads.describe()}", file=sys.stderr, flush=True)
        print(f"moespec: matrix products in {engine.math} ({MATH_REASONS[engine.math, args.math is not None]})",
              file=sys.stderr, flush=True)
    return engine


MATH_REASONS = {
    ("amx", False): "this CPU has the AMX tile unit and the kernel grants it; --math bf16 or fp32 for the vector "
                    "units",
    ("amx", True): "--math amx",
    ("bf16", False): "this CPU multiplies bf16 pairs natively, measured at start-up at 1.25x float32's product rate "
                     "or more; --math fp32 for float32",
    ("fp32", False): "this CPU multiplies bf16 pairs no faster than float32 (none natively, or measured at start-up "
                     "below 1.25x float32's product rate): --math bf16 would round the inputs and gain nothing",
    ("bf16", True): "--math bf16",
    ("fp32", True): "--math fp32",
}


def _sglang_module():
    """service.sglang_backend's CLI hooks; importing it imports neither sglang nor CUDA."""
    try:
        return importlib.import_module("service.sglang_backend")
    except ModuleNotFoundError as e:
        if e.name and "service.sglang_backend".startswith(e.name):
            return None
        raise


def _read(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None


def _announce(server: MoespecServer) -> None:
    print(f"moespec serving on {server.address}", flush=True)
