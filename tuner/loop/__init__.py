"""The tuning loop: the search space, the Optuna study and sampler, ask -> measure -> tell with the
incumbent in between (one-shot and continuous), pruning, and wiring a Tuner from settings."""
