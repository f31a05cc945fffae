"""`moespec serve`'s batching flags default to exactly what EngineConfig defaults to (both read
service.engine_defaults), and its --help shows the numbers."""

from __future__ import annotations

import argparse
import subprocess
import sys

from service.cli import serve
from service.engine import EngineConfig


def test_serve_batching_defaults_are_the_engine_config_defaults():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args([])
    config = EngineConfig()
    assert (args.max_batch, args.prefill_chunk) == (config.max_batch, config.prefill_chunk)


def test_serve_help_shows_the_defaults():
    out = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--help"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    help_text = " ".join(out.stdout.split())
    config = EngineConfig()
    assert f"default {config.max_batch}" in help_text and f"default {config.prefill_chunk}" in help_text
