"""What-if replay: from one run recorded at draft length k, predict what every shorter draft length
k' <= k would cost, without running it.

- `fit`: the cost model fitted on the recorded run (verify pass and draft seconds).
- `replay`: the walk of a k'-run over a request's recorded positions (its steps and their drafts).
- `predict`: `predict()`, which prices the walked steps and returns the `WhatIf` of every k'.
- `present`: the table `moespec whatif` prints and the plot it saves.
- `hint`: the tuner's use of it, the best shorter length for a measured trial.
Its command line, `moespec whatif FILE`, is service/cli/whatif.py.
"""
