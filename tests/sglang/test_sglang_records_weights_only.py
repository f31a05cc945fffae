"""A planted SGLang dump file cannot run code in the server: records are read weights-only, and a file
that needs a full unpickle is refused with RecorderFormatError instead."""

from __future__ import annotations

import pathlib

import pytest
import torch

from service.sglang_backend.records import RecorderFormatError, load_dump


class _TouchOnUnpickle:
    """Unpickling this calls Path.touch(marker): the stand-in for any code a planted pickle names."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_a_planted_pickle_that_would_run_code_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "code-ran"
    dump = tmp_path / "expert_distribution_recorder_1.0_0.pt"
    torch.save({"records": [_TouchOnUnpickle(marker)]}, dump)
    with pytest.raises(RecorderFormatError, match="weights-only"):
        load_dump(dump)
    assert not marker.exists(), "the planted file's code ran"
