"""`moespec generate` as a user runs it: completion on stdout, the per-step table on stderr, and a
one-line error with exit code 2 for a bad argument."""

from __future__ import annotations

import subprocess
import sys

COMMAND = [sys.executable, "-m", "service.cli", "generate"]


def test_generate_prints_the_completion_and_a_step_table():
    out = subprocess.run([*COMMAND, "--prompt", "def add(a, b):\n", "--max-new-tokens", "12",
                          "--drafter", "ngram", "--draft-length", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    table = out.stderr.splitlines()
    assert table[0].split()[:4] == ["step", "drafted", "accepted", "committed"]
    assert "committed 12" in table[-1] and "per committed token" in table[-1]


def test_bad_argument_exits_2_with_a_one_line_reason():
    out = subprocess.run([*COMMAND, "--prompt", "x", "--top-p", "1.5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "sampling.top_p" in lines[0]


def test_generate_takes_a_controller_and_refuses_a_bad_cost_weight():
    """The greedy completion under an adaptive controller is the plain one (lossless)."""
    base = [*COMMAND, "--prompt", "def add(a, b):\n", "--max-new-tokens", "16", "--temperature", "0", "--no-table"]
    plain = subprocess.run(base, capture_output=True, text=True, timeout=120)
    adaptive = subprocess.run([*base, "--drafter", "ngram", "--draft-length", "8", "--controller", "moespec"],
                              capture_output=True, text=True, timeout=120)
    assert plain.returncode == adaptive.returncode == 0, adaptive.stderr
    assert adaptive.stdout == plain.stdout and plain.stdout.strip()
    bad = subprocess.run([*base, "--draft-length", "2", "--controller", "moespec", "--cost-weight", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "policy.cost_weight" in bad.stderr.strip().splitlines()[-1]


def test_generate_takes_table_cells_and_names_a_bad_one():
    base = [*COMMAND, "--prompt", "def add(a, b):\n", "--max-new-tokens", "16", "--temperature", "0", "--no-table"]
    plain = subprocess.run(base, capture_output=True, text=True, timeout=120)
    table = subprocess.run([*base, "--cell", "b1-1.greedy=ngram-k4", "--cell", "b2+.any=model-k2-t0"],
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == table.returncode == 0, table.stderr
    assert table.stdout == plain.stdout and plain.stdout.strip()
    for cell, named in (("b1.greedy=ngram-k4", "LABEL=POLICY_ID"),
                        ("b1-1.any=ngram-k9", "policy.cells[0].policy.draft_length")):
        bad = subprocess.run([*base, "--cell", cell], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and named in bad.stderr.strip().splitlines()[-1], bad.stderr


def test_generate_refuses_a_tree_it_cannot_draft_in_one_line_naming_the_field():
    base = [*COMMAND, "--prompt", "x", "--max-new-tokens", "4", "--no-table"]
    for extra, problem in ((["--drafter", "ngram", "--draft-length", "3", "--tree-width", "2"], "chains only"),
                           (["--draft-length", "3", "--tree-width", "9"], "must be in [1, 4]"),
                           (["--draft-length", "3", "--tree-width", "2", "--controller", "cascade"], "chain lengths")):
        bad = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60)
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1, bad.stderr
        assert "policy.tree_width" in lines[0] and problem in lines[0]
