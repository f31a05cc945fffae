"""The error a subcommand raises for a bad argument found after parsing (exit 2, one line).

Kept out of cli.py so that `python -m service.cli` (which runs cli.py as __main__ and imports it
again as service.cli) still catches the one class the subcommands raise.
"""


class UsageError(Exception):
    """A bad command-line argument; the message names it."""
