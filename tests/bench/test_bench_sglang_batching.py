"""`moespec bench sglang-batching`: the share of SGLang's batching gain and the on/off ratio are
computed per round from the tokens/s of each contender, then summarised as median [min, max]; bad
arguments are refused before any server starts."""

import subprocess
import sys

from service.bench.sglang_batching import markdown, summarise


def a_round(alone_one, alone_eight, moespec_one, moespec_eight, bare_eight):
    return {"alone": {"1": alone_one, "8": alone_eight}, "moespec": {"1": moespec_one, "8": moespec_eight},
            "moespec-no-stats": {"1": moespec_one, "8": bare_eight}}


def test_each_round_compares_its_own_gains_and_the_summary_is_their_median_and_range():
    rounds = [a_round(40, 160, 40, 120, 120),    # gains 4x and 3x: share 0.75, on/off 1.0
              a_round(50, 150, 40, 120, 100),    # gains 3x and 3x: share 1.0, on/off 1.2
              a_round(40, 200, 20, 100, 125)]    # gains 5x and 5x: share 1.0, on/off 0.8
    summary = summarise(rounds, [8])["8"]
    assert summary["share_of_gain"] == {"median": 1.0, "min": 0.75, "max": 1.0}
    assert summary["stats_on_vs_off"] == {"median": 1.0, "min": 0.8, "max": 1.2}
    assert summary["alone_gain"]["median"] == 4.0 and summary["moespec_gain"]["median"] == 3.0
    result = {"device": "cpu", "cpu": "a CPU", "prompts": 16, "max_new_tokens": 32, "clients": [8], "bursts": 4,
              "rounds": rounds, "summary": summarise(rounds, [8])}
    table = markdown(result)
    assert "4 burst(s)" in table and "| 8 | 160.00 [150.00, 200.00] |" in table
    assert "1.00x [0.75, 1.00] | 1.00x [0.80, 1.20] |" in table


def test_zero_bursts_are_refused_before_any_server_starts():
    done = subprocess.run([sys.executable, "-m", "service.cli", "bench", "sglang-batching", "--bursts", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--bursts" in done.stderr and "must be >= 1" in done.stderr
