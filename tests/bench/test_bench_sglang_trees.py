"""`moespec bench sglang-trees`: each policy's rounds summarised as median [min, max] and tabled chain first
per length; bad arguments are refused before any server starts."""

import subprocess
import sys

import pytest

from service.bench.sglang_trees import markdown, policies, summary
from service.types import Drafter, DraftPolicy


def test_a_chain_and_each_width_run_at_every_length():
    class Args:
        lengths, widths = [2, 4], [3]

    assert [(p.draft_length, p.tree_width) for p in policies(Args)] == [(2, 1), (2, 3), (4, 1), (4, 3)]
    assert all(p.drafter is Drafter.MODEL and p.draft_temperature == 0.0 for p in policies(Args))


def test_the_summary_is_the_median_and_range_of_the_rounds():
    rounds = [{"accepted_per_pass": 3.0, "tree_union": 22.0, "branch_union": 21.0, "tokens_per_s": 90.0},
              {"accepted_per_pass": 3.0, "tree_union": 22.0, "branch_union": 21.0, "tokens_per_s": 100.0},
              {"accepted_per_pass": 3.0, "tree_union": 22.0, "branch_union": 21.0, "tokens_per_s": 96.0}]
    row = summary(DraftPolicy(Drafter.MODEL, 4, 0.0, policy_id="k4-w2", tree_width=2), rounds)
    assert row["tokens_per_s"] == {"median": 96.0, "min": 90.0, "max": 100.0}
    assert row["accepted_per_pass"]["median"] == 3.0 and (row["draft_length"], row["tree_width"]) == (4, 2)
    table = markdown({"device": "cpu", "cpu": "a CPU", "tree_temperature": "0.15", "prompts": 8, "rounds": 3,
                      "max_new_tokens": 32, "rows": [row]})
    assert "trees ranked at temperature 0.15" in table
    assert "| 4 | 2 | 3.00 [3.00-3.00] | 22.0 [22.0-22.0] | 21.0 [21.0-21.0] | 96.0 [90.0-100.0] |" in table


@pytest.mark.parametrize(("argv", "message"), [
    (["--lengths", "1", "4"], "--lengths >= 2"),
    (["--widths", "5"], "--widths must lie in [2, 4]"),
    (["--rounds", "0"], "must be >= 1"),
])
def test_bad_arguments_are_refused_before_any_server_starts(argv, message):
    done = subprocess.run([sys.executable, "-m", "service.cli", "bench", "sglang-trees", *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
