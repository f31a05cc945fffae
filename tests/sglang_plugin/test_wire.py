"""The plugin's record format: what the scheduler encodes is what the server decodes; anything else is
refused with a WireError, never half-read."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from service.sglang_plugin import wire


def a_pass(topk: bool, tree: bool = False) -> wire.PassStats:
    rng = np.random.default_rng(0)
    b, w, layers = 3, 4, 2
    return wire.PassStats(
        pass_id=7, mode=5, rids=("a", "b", "c"), width=w, start_ns=1, end_ns=2,
        input_ids=rng.integers(0, 1000, b * w).astype(np.int32), positions=np.arange(b * w, dtype=np.int32),
        unions=rng.integers(8, 32, (b, layers)).astype(np.int16), batch_union=np.array([30, 31], np.int16),
        pair_mean=rng.random((b, layers)).astype(np.float32), pair_min=np.ones((b, layers), np.int16),
        topk=rng.integers(-1, 64, (layers, b * w, 8)).astype(np.int16) if topk else None,
        next_token=np.tile(np.array([1, 3, -1, -1], np.int16), b) if tree else None,
        next_sibling=np.tile(np.array([-1, 2, -1, -1], np.int16), b) if tree else None,
        path_unions=rng.integers(8, 24, (b, w, layers)).astype(np.int16) if tree else None)


@pytest.mark.parametrize(("topk", "tree", "paths"), [(False, False, False), (True, False, False),
                                                    (False, True, False), (False, True, True), (True, True, True)])
def test_a_pass_survives_the_wire(topk, tree, paths):
    sent = a_pass(topk, tree)
    if not paths:
        sent = dataclasses.replace(sent, path_unions=None)  # links of a chain or NGRAM window: no path unions
    got = wire.decode(wire.encode_pass(sent))
    for field in ("pass_id", "mode", "rids", "width", "start_ns", "end_ns"):
        assert getattr(got, field) == getattr(sent, field)
    for field in ("input_ids", "positions", "unions", "batch_union", "pair_mean", "pair_min"):
        assert np.array_equal(getattr(got, field), getattr(sent, field)), field
    assert (got.topk is None) == (not topk) and (not topk or np.array_equal(got.topk, sent.topk))
    assert (got.next_token is None) == (not tree)
    assert not tree or (np.array_equal(got.next_token, sent.next_token)
                        and np.array_equal(got.next_sibling, sent.next_sibling)
                        and (got.path_unions is None) == (not paths)
                        and (not paths or np.array_equal(got.path_unions, sent.path_unions)))


def test_hello_and_the_config_survive():
    assert wire.decode(wire.encode_hello(wire.Hello(pid=3, layers=4, experts=64))) == wire.Hello(3, 4, 64)
    config = wire.TapConfig("ipc:///tmp/x", capture_topk=True)
    assert wire.TapConfig.from_env(config.to_env()) == config and wire.TapConfig.from_env("") is None


@pytest.mark.parametrize(("frames", "reason"), [
    ([b"not json"], "not a moespec tap message"),
    ([b'{"v": 1, "kind": "pass"}'], "version 1"),
    ([b'{"v": 3, "kind": "gossip"}'], "unknown tap message kind"),
], ids=["garbage", "other-version", "other-kind"])
def test_foreign_messages_are_refused_by_name(frames, reason):
    with pytest.raises(wire.WireError, match=reason):
        wire.decode(frames)


def test_a_short_frame_is_refused():
    frames = wire.encode_pass(a_pass(False))
    frames[3] = frames[3][:-2]
    with pytest.raises(wire.WireError, match="expected shape"):
        wire.decode(frames)
    with pytest.raises(wire.WireError, match="frames"):
        wire.decode(frames[:-1])
