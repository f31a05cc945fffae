"""The embedded engine's batching defaults, declared once.

`EngineConfig` takes its field defaults from here and `moespec serve` its --max-batch and
--prefill-chunk defaults. Outside service.engine and importing nothing, so the command line reads
them without importing the engine (any module under service.engine imports the whole package).
"""

MAX_BATCH = 32  # requests verified together in one pass (KV-cache slots); more wait
# Newcomers' prompt tokens per prefill pass (chunked prefill, one such pass between two steps of
# the running requests): bounds how long a long prompt can stall them (why 2048: docs/engine.md).
PREFILL_CHUNK = 2048
# Greedy steps one kernel call may run back to back (scheduler.py, `_steps_in_one_call`: plain steps, and a
# lone request's draft-head chain at draft temperature 0): the Python around a step then runs once per
# call. A newcomer, a cancellation or a deadline waits for the call: up to this many steps (~2 ms of plain
# steps at the shipped model's ~0.23 ms on 2 cores, ~10 ms of draft-head steps of 7 positions).
STEPS_PER_CALL = 8
