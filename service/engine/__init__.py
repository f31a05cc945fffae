"""The embedded pure-PyTorch engine: model, speculative step, sampling, drafters, weights."""

from service.engine.engine import Engine, EngineConfig, unique_experts_per_layer

__all__ = ["Engine", "EngineConfig", "unique_experts_per_layer"]
