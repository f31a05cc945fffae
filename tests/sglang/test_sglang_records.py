"""The SGLang 0.5.23 per_token recorder files and meta_info are read as SGLang writes them."""

from __future__ import annotations

import pytest
import torch

from service.sglang_backend.meta_info import EngineAborted, SpecMeta, finish_reason
from service.sglang_backend.records import ForwardMode, RecorderFormatError, dump_files, load_dump, to_logical
from service.types import FinishReason, InvalidRequest
from tests.fixtures.sglang.scenario import load


def test_dump_files_pick_one_rank_in_write_order(tmp_path):
    for name in ("expert_distribution_recorder_20.5_0.pt", "expert_distribution_recorder_3.25_0.pt",
                 "expert_distribution_recorder_3.25_1.pt", "unrelated.pt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in dump_files(tmp_path, rank=0)] == [
        "expert_distribution_recorder_3.25_0.pt", "expert_distribution_recorder_20.5_0.pt"]


def test_speculative_dump_holds_target_and_draft_passes_in_run_order():
    s = load("speculative")
    [path] = dump_files(s.folder, rank=0)
    passes = load_dump(path, start_index=10)
    assert [p.index for p in passes] == list(range(10, 10 + len(passes)))
    modes = [p.mode for p in passes]
    assert modes[:3] == [ForwardMode.EXTEND, ForwardMode.EXTEND, ForwardMode.IDLE]
    assert {ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2} <= set(modes)
    verify = [p for p in passes if p.mode == ForwardMode.TARGET_VERIFY]
    assert verify[0].extend_seq_lens is None  # SGLang leaves it unset for TARGET_VERIFY
    assert verify[0].topk_ids.shape == (4, 8, 8)  # [L, 2 requests x window 4, recorder width 8]
    layers = tuple(range(4))
    assert all(p.has_routing(layers) for p in verify)
    assert not any(p.has_routing(layers) for p in passes if p.mode in (ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND_V2))


def test_redundant_physical_experts_map_to_their_logical_expert():
    mapping = torch.tensor([[0, 1, 2, 0]])  # physical slot 3 is a second copy of logical expert 0
    ids = torch.tensor([[[3, 1, -1], [0, 2, -1]]], dtype=torch.int32)  # [L=1, n=2, 3]
    assert to_logical(ids, mapping).tolist() == [[[0, 1, -1], [0, 2, -1]]]


def test_plain_dump_keeps_dense_layers_and_top4_padding_as_minus_one():
    s = load("plain")
    passes = load_dump(dump_files(s.folder)[0])
    decode = next(p for p in passes if p.mode == ForwardMode.DECODE)
    assert (decode.topk_ids[0] == -1).all()  # layer 0 is dense
    assert (decode.topk_ids[1:, :, 4:] == -1).all()  # top-4 fills 4 of the 8 columns
    assert int(decode.topk_ids[1:, :, :4].max()) < 16  # physical 16..19 were mapped to logical 0..3
    mixed = next(p for p in passes if p.mode == ForwardMode.MIXED)
    assert mixed.extend_seq_lens == (2, 1)


def test_a_stat_mode_dump_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "expert_distribution_recorder_1.0.pt"
    torch.save({"rank": 0, "logical_count": torch.zeros(2, 4), "average_utilization_rate_over_window": None}, path)
    with pytest.raises(RecorderFormatError, match="per_token"):
        load_dump(path)


def test_a_per_pass_record_without_token_ids_is_refused(tmp_path):
    path = tmp_path / "expert_distribution_recorder_1.0_0.pt"
    torch.save({"records": [{"forward_pass_id": 1, "rank": 0, "global_physical_count": torch.zeros(2, 4)}],
                "last_physical_to_logical_map": torch.arange(4).repeat(2, 1)}, path)
    with pytest.raises(RecorderFormatError, match="lacks"):
        load_dump(path)


def test_spec_meta_reads_the_0_5_23_field_names():
    s = load("speculative")
    meta = SpecMeta.from_meta_info(s.meta["A"])
    assert meta.verify_ct == 3 and meta.correct_drafts == 5 and meta.proposed_drafts == 9
    assert meta.histogram == (1, 0, 1, 1)
    # Draft 1 was accepted in the passes that accepted >= 1 drafts, draft 3 only in the a=3 pass.
    assert meta.accepted_per_position(3) == (2, 2, 1)


def test_meta_without_spec_fields_means_no_speculation():
    assert SpecMeta.from_meta_info(load("plain").meta["C"]) is None


def test_finish_reasons_map_and_an_unrequested_abort_raises():
    assert finish_reason({"finish_reason": {"type": "length", "length": 9}}, cancelled=False) is FinishReason.LENGTH
    assert finish_reason({"finish_reason": {"type": "stop", "matched": 0}}, cancelled=False) is FinishReason.STOP
    aborted = {"finish_reason": {"type": "abort", "message": "input too long"}}
    assert finish_reason(aborted, cancelled=True) is FinishReason.CANCELLED
    with pytest.raises(EngineAborted, match="input too long"):
        finish_reason(aborted, cancelled=False)
    refused = {"finish_reason": {"type": "abort", "status_code": 400, "message": "longer than the context"}}
    with pytest.raises(InvalidRequest) as e:
        finish_reason(refused, cancelled=False)
    assert e.value.field == "prompt"


def test_a_record_with_a_numpy_int_still_loads(tmp_path):
    import numpy as np

    path = tmp_path / "expert_distribution_recorder_1.0_0.pt"
    torch.save({"records": [{"input_ids": [7], "positions": [np.int64(3)], "extend_seq_lens": None,
                             "forward_mode": 2, "topk_ids_of_layer": torch.zeros(2, 1, 8, dtype=torch.int32)}],
                "last_physical_to_logical_map": torch.arange(8).repeat(2, 1)}, path)
    [p] = load_dump(path)
    assert p.positions == (3,) and p.mode == ForwardMode.DECODE
