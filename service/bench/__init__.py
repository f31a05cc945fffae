"""The benchmark programs behind `moespec bench SUITE`, one module per suite (each defines its own
flags with `add_arguments(parser)` and runs with `run(args)`). The table of suites, and the
`moespec bench` dispatcher that reads it, are command line: service/cli/bench.py."""
