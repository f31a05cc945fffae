"""Shared pieces of the engine tests: the shipped model pair, loaded once per module that asks."""

from __future__ import annotations

import json

from service.engine import Engine, EngineConfig
from service.engine.weights import MODELS_DIR

PROMPTS_FILE = MODELS_DIR.parent / "prompts" / "heldout.jsonl"


def heldout_prompts(count: int) -> list[str]:
    lines = PROMPTS_FILE.read_text().splitlines()[:count]
    return [json.loads(line)["prompt"] for line in lines]


def make_engine(**overrides) -> Engine:
    # One intra-op thread: the per-step ops are small, and other test processes may share the cores.
    return Engine(EngineConfig(**{"threads": 1, **overrides}))
