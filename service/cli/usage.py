"""The error a subcommand raises for a bad argument found after parsing (exit 2, one line).

Its own module so that subcommand modules can raise it without importing the dispatcher.
"""


class UsageError(Exception):
    """A bad command-line argument; the message names it."""
