"""The embedded pure-PyTorch engine: model, speculative step, sampling, drafters, weights."""

from service.engine.engine import Engine, EngineConfig, MathUnavailable

__all__ = ["Engine", "EngineConfig", "MathUnavailable"]
