"""The `moespec` command line: one entry point, one module per subcommand, imported on use.

Each subcommand module defines `add_arguments(parser)` and `run(args) -> int`. Bad arguments exit
with code 2 and a one-line reason (argparse's own behaviour, kept for our own checks too).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from service.errors import UsageError

__all__ = ["COMMANDS", "UsageError", "main"]

# name -> (module, one-line help). Modules are imported only when their command runs, so
# `moespec --help` stays fast and optional extras (sglang) are never imported by accident.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("service.cli.serve", "serve the gRPC Inference and PolicyAdmin services"),
    "generate": ("service.cli.generate", "generate in-process and print a per-step table"),
    "client": ("service.cli.client", "talk to a running server: generate, policy get|set, info"),
    "bench": ("service.cli.bench", "benchmark the engine (and a server) and print figures"),
    "loadgen": ("service.cli.loadgen", "send the shipped prompt workload to a server"),
    "tune": ("service.cli.tune", "run the online draft-policy tuner against a server"),
    "demo": ("service.cli.demo", "server + load + tuner on the embedded model, then a report"),
    "whatif": ("service.cli.whatif", "predict the cost of shorter draft lengths from a step recording"),
    "healthcheck": ("service.cli.healthcheck", "container health check: ask the running server where its own "
                                               "flags say it listens (port, TLS)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Only the chosen command's module is imported to add its arguments."""
    parser = argparse.ArgumentParser(
        prog="moespec",
        description="Speculative decoding for Mixture-of-Experts models, measured per layer and tuned online.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=module)
        if name == chosen:
            importlib.import_module(module).add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except UsageError as e:
        parser.exit(2, f"moespec {args.command}: error: {e}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
