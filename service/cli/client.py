"""`moespec client`: talk to a running server — generate, policy get|set|split, info, health.

Exit codes: 0 ok, 1 the server answered with an error (printed as `CODE: details`) or is not
serving, 2 bad arguments. The admin token comes from --admin-token-file, --admin-token or MOESPEC_ADMIN_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

import grpc

from service.cli.generate import add_controller_arguments, cells_from_args
from service.errors import UsageError
from service.policy.traffic import TrafficArm, TrafficSplit
from service.security import admin_token
from service.server.client import MoespecClient, Reply
from service.types import Controller, Drafter, DraftPolicy, GenerationRequest, SamplingParams

ADMIN_TOKEN_ENV = admin_token.ADMIN_TOKEN_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the server")
    common.add_argument("--tls-ca", help="PEM file of the CA that signed the server certificate (enables TLS)")
    common.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="with --tls-ca: the name the server certificate must carry, when --server's host is "
                             "another (an IP address)")
    common.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    common.add_argument("--json", action="store_true", help="print the whole answer as JSON")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    gen = sub.add_parser("generate", parents=[common], help="generate text", description="generate text")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy (server default 1.0)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--stream", action="store_true", help="print tokens as the server commits them")

    pol = sub.add_parser("policy", help="get or set the draft policy", description="get or set the draft policy")
    pol_sub = pol.add_subparsers(dest="policy_action", metavar="get|set|split", required=True)
    helps = {"get": "get the current draft policy (--split: the whole traffic split)",
             "set": "set one draft policy for all traffic",
             "split": "serve several policies at once: each request is assigned one --arm by weight"}
    for name in ("get", "set", "split"):
        p = pol_sub.add_parser(name, parents=[common], help=helps[name], description=helps[name])
        admin_token.add_arguments(p, "for PolicyAdmin")
        if name == "get":
            p.add_argument("--split", action="store_true", help="print every arm with its weight and the seed")
        if name == "split":
            p.add_argument("--arm", action="append", required=True, metavar="WEIGHT:DRAFTER:LENGTH[:TEMP[:ID]]",
                           help="one arm, e.g. 0.9:model:0 (plain) or 0.1:ngram:4::trial-7 (repeatable)")
            p.add_argument("--seed", type=int, default=None, help="seed of the per-request draws (default: random)")
        if name == "set":
            p.add_argument("--drafter", choices=[d.value for d in Drafter], default=Drafter.MODEL.value)
            p.add_argument("--draft-length", type=int, required=True, help="0 = no speculation")
            p.add_argument("--draft-temperature", type=float, default=1.0)
            add_controller_arguments(p)
            p.add_argument("--policy-id", default="", help="label reported in responses (default: derived)")

    sub.add_parser("info", parents=[common], help="print the model and backend description")
    sub.add_parser("health", parents=[common], help="exit 0 if the server reports SERVING, else 1")


def run(args: argparse.Namespace) -> int:
    token = admin_token.resolve(args, os.environ)
    try:
        client = MoespecClient(args.server, admin_token=token, tls_ca=args.tls_ca,
                               tls_server_name=args.tls_server_name)
    except OSError as e:
        raise UsageError(f"cannot read --tls-ca: {e}") from None
    with client:
        try:
            return _ACTIONS[args.action](client, args)
        except grpc.RpcError as e:
            print(f"{e.code().name}: {e.details()}", file=sys.stderr)
            return 1


def _generate(client: MoespecClient, args: argparse.Namespace) -> int:
    d = SamplingParams()
    request = GenerationRequest(
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(
            temperature=d.temperature if args.temperature is None else args.temperature,
            top_p=d.top_p if args.top_p is None else args.top_p,
            top_k=d.top_k if args.top_k is None else args.top_k,
            seed=args.seed,
        ),
        stop=tuple(args.stop),
    )
    if not args.stream:
        reply = client.generate(request, timeout=args.timeout)
        print(_dump(asdict(reply)) if args.json else reply.text)
        if not args.json:
            _summary(reply)
        return 0
    for chunk in client.stream(request, timeout=args.timeout):
        if not args.json:
            print(chunk.text, end="", flush=True)
        if chunk.reply is not None:
            if args.json:
                print(_dump(asdict(chunk.reply)))
            else:
                print()
                _summary(chunk.reply)
    return 0


def parse_arm(spec: str) -> TrafficArm:
    """WEIGHT:DRAFTER:LENGTH[:TEMPERATURE[:POLICY_ID]] -> TrafficArm (UsageError when malformed)."""
    parts = spec.split(":", 4)
    if len(parts) < 3:
        raise UsageError(f"--arm {spec!r}: expected WEIGHT:DRAFTER:LENGTH[:TEMPERATURE[:POLICY_ID]]")
    weight, drafter, length = parts[:3]
    temperature = parts[3] if len(parts) > 3 and parts[3] else str(DraftPolicy().draft_temperature)
    policy_id = parts[4] if len(parts) > 4 else ""
    try:
        return TrafficArm(DraftPolicy(Drafter(drafter), int(length), float(temperature), policy_id), float(weight))
    except ValueError:
        raise UsageError(f"--arm {spec!r}: weight and temperature must be numbers, length an integer, drafter "
                         f"one of {', '.join(d.value for d in Drafter)}") from None


def _policy(client: MoespecClient, args: argparse.Namespace) -> int:
    if args.policy_action == "split":
        split = TrafficSplit(tuple(parse_arm(a) for a in args.arm), args.seed)
        print(_dump(asdict(client.set_split(split, timeout=args.timeout))))
        return 0
    if args.policy_action == "get" and args.split:
        print(_dump(asdict(client.get_split(timeout=args.timeout))))
        return 0
    if args.policy_action == "get":
        policy = client.get_policy(timeout=args.timeout)
    else:
        policy = client.set_policy(
            DraftPolicy(Drafter(args.drafter), args.draft_length, args.draft_temperature, args.policy_id,
                        Controller(args.controller), args.cost_weight, cells_from_args(args), args.tree_width),
            timeout=args.timeout,
        )
    print(_dump(asdict(policy)))
    return 0


def _info(client: MoespecClient, args: argparse.Namespace) -> int:
    print(_dump(asdict(client.model_info(timeout=args.timeout))))
    return 0


def _health(client: MoespecClient, args: argparse.Namespace) -> int:
    status = client.health(timeout=args.timeout or 5.0)
    print(status)
    return 0 if status == "SERVING" else 1


_ACTIONS = {"generate": _generate, "policy": _policy, "info": _info, "health": _health}


def _summary(reply: Reply) -> None:
    s = reply.spec
    tree = f", tree width {s.tree_width}" if s.tree_width > 1 else ""
    branch = (f" (one branch of the tree: {[round(u, 1) for u in s.branch_unique_experts_mean]})"
              if s.branch_unique_experts_mean else "")
    print(
        f"[{reply.finish_reason.value}] {reply.completion_tokens} tokens in {reply.seconds:.3f}s; "
        f"policy {s.policy_id} ({s.drafter.value}, k={s.draft_length}{tree}): {s.verify_steps} steps, "
        f"accepted {s.accepted_tokens}/{s.drafted_tokens}; unique experts per layer "
        f"{[round(u, 1) for u in s.unique_experts_mean]}{branch}",
        file=sys.stderr,
    )


def _dump(obj: object) -> str:
    return json.dumps(obj, default=lambda o: getattr(o, "value", str(o)), indent=2)
