"""Draft policies as clients and the tuner name them: policy ids, traffic splits, what a backend offers."""
