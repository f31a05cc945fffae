"""`moespec bench draft` end to end on a real `moespec serve`, at its smallest: every policy gets its
own row (a draft tree beside the chains), plain decoding is the unit, and the per-pass union of experts
is the engine's."""

from __future__ import annotations

import argparse
import json

from service.bench import draft


def test_bench_draft_measures_every_policy_through_a_real_server(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    draft.add_arguments(parser)
    args = parser.parse_args(["--requests", "2", "--max-new-tokens", "6", "--rounds", "1", "--lengths", "2",
                              "--draft-temperatures", "0", "0.8", "--ngram-lengths", "2", "--out", str(tmp_path)])
    assert draft.run(args) == 0
    figures = json.loads((tmp_path / "draft-bench.json").read_text())
    rows = {(r["workload"], r["policy"]): r for r in figures["rows"]}
    workloads = {w for w, _ in rows}
    assert len(workloads) == 2
    for workload in workloads:
        assert {p for w, p in rows if w == workload} == {"plain", "ngram k=2", "model k=2 T=0", "model k=2 T=0.8",
                                                         "tree k=2 w=2 T=0"}
        plain = rows[workload, "plain"]
        assert plain["speed"] == 1.0 and plain["verify_cost"] == 1.0 and plain["draft_cost"] == 0.0
        assert plain["unique_experts"] == [8.0] * 4  # one position per pass: exactly its top-8
        model = rows[workload, "model k=2 T=0"]
        assert model["draft_cost"] > 0 and all(u > 8.0 for u in model["unique_experts"])
        assert 0 <= model["acceptance"] <= 1
        tree = rows[workload, "tree k=2 w=2 T=0"]  # a tree of 2 nodes: a pass accepts at most both
        assert tree["tree_width"] == 2 and 0 <= tree["accepted_per_pass"] <= 2 and tree["verify_cost"] > 0
        assert all(u > 8.0 for u in tree["unique_experts"])
    assert figures["headline"][next(iter(workloads))]["trees_against_chains"][0]["node_budget"] == 2
    assert (tmp_path / "draft-bench.png").stat().st_size > 0
    assert "best model drafter" in capsys.readouterr().out
