"""The speculative wing: drafting (draft head, n-gram), sampling and lossless acceptance, the adaptive rule."""
