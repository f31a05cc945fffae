"""The error every entry point raises for a bad argument found after parsing (exit 2, one line).

Its own module so that subcommands, benchmarks, the tuner and the backends can raise it without
importing the command-line package; `service.cli.main` turns it into `moespec CMD: error: ...`.
"""


class UsageError(Exception):
    """A bad command-line argument; the message names it."""
