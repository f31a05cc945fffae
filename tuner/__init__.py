"""The online draft-policy tuner, its load generator and the `moespec demo` driver.

Flow: OTLP request spans -> `measurement.collector` (grouped by policy id) -> `measurement.window`
accounting -> `loop.tuning` (Optuna ask/tell over `loop.study` storage, one trial at a time in
`loop.trial`, policies applied through `measurement.admin`) -> `drivers.report`. The command lines
(`moespec tune`, `loadgen`, `demo`) live in service/cli/.
"""
