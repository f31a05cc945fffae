"""`python -m service.bench.verify_cost ...`: the same as `moespec bench verify-cost ...`, without the
command line's other imports (for a GPU machine that has torch and nothing else)."""

import argparse
import sys

from service.bench.verify_cost import command
from service.errors import UsageError

parser = argparse.ArgumentParser(prog="verify-cost")
command.add_arguments(parser)
try:
    sys.exit(command.run(parser.parse_args()))
except UsageError as e:
    parser.error(str(e))
