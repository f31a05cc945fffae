"""Adaptive speculation: how many drafts each request verifies at each step.

A policy's `controller` (service.types.Controller) picks the rule and its draft_length is then the
most a step may draft:
- static: every step drafts draft_length (cut to the token budget);
- moespec: expected gain of one more draft against its union-aware marginal cost (rule.py);
- sglang-ema, transformers-heuristic, cascade: published rules as baselines (baselines.py).
controller.py holds the interface the scheduler calls and why every rule keeps decoding lossless;
estimates.py what is learned online; state.py the engine-wide estimates and the controllers' factory.
"""
