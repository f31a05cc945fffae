"""The online draft-policy tuner, its load generator and the `moespec demo` driver.

Flow: OTLP request spans -> `collector` (grouped by policy id) -> `window` accounting -> `tuning`
loop (Optuna ask/tell over `study` storage, policies applied through `admin`) -> `report`.
"""
