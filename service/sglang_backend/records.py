"""Read the files SGLang 0.5.23's expert-distribution recorder writes in `per_token` mode.

Format (python/sglang/srt/eplb/expert_distribution.py in the 0.5.23 wheel; see
tests/fixtures/sglang/README.md for the exact lines): `dump_record()` torch.saves one file per rank,
`{SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR}/expert_distribution_recorder_{time.time()}_{rank}.pt`,
holding `{"records": [...], "last_physical_to_logical_map": LongTensor[L, P]}`. Every record is one
forward pass of any model runner in the scheduler process (target *and* draft):
    forward_pass_id int (per runner, so target and draft ids collide; list order is run order),
    rank int, gatherer_key "primary",
    input_ids list[int] [n], positions list[int] [n],
    extend_seq_lens list[int] | None (None for DECODE and TARGET_VERIFY),
    forward_mode int (ForwardMode value below),
    topk_ids_of_layer IntTensor [L, n, 8]: *physical* routed expert ids per layer and token,
        -1 where nothing was written (dense layers, draft passes, top_k < 8),
    misc_objects list, global_physical_count IntTensor [L, P].
No request ids: `attribution.py` splits a pass per request.

Shape legend: L layers of the model (dense ones included), n tokens of the pass, P physical experts.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

# The recorder's per-token buffer is 8 wide (`_DetailSinglePassGatherer._TOP_K_NUM`).
RECORDER_TOPK_WIDTH = 8
DUMP_GLOB = "expert_distribution_recorder_*_{rank}.pt"


class ForwardMode(enum.IntEnum):
    """sglang.srt.model_executor.forward_batch_info.ForwardMode in 0.5.23 (auto() from 1)."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5
    DRAFT_EXTEND_V2 = 6
    PREBUILT = 7
    SPLIT_PREFILL = 8
    DLLM_EXTEND = 9


class RecorderFormatError(ValueError):
    """The file is not a per_token dump of the format above (another mode or SGLang version)."""


@dataclass(frozen=True)
class ForwardPass:
    """One recorded forward pass: expert ids mapped to logical ids, and the physical ones as recorded
    (the slot each pair really went to; the EP view needs them, see ep.py)."""

    index: int  # position in the dump order (the run order)
    mode: int  # a ForwardMode value; unknown values are kept and ignored downstream
    input_ids: tuple[int, ...]  # [n]
    positions: tuple[int, ...]  # [n]
    extend_seq_lens: tuple[int, ...] | None
    topk_ids: torch.Tensor  # [L, n, 8] int32 logical expert ids, -1 = none
    physical_ids: torch.Tensor  # [L, n, 8] int32 physical slot ids as recorded, -1 = none
    physical_to_logical: torch.Tensor | None  # [L, S] int64, the dump's map (None: the dump had none)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def has_routing(self, layers: tuple[int, ...]) -> bool:
        """False for passes of a dense model (the draft): nothing was written in the MoE layers."""
        return bool((self.topk_ids[list(layers)] >= 0).any()) if self.num_tokens else False


_RECORD_KEYS = ("input_ids", "positions", "extend_seq_lens", "forward_mode", "topk_ids_of_layer")


def _numpy_scalar_globals() -> list:
    """What a pickled numeric numpy scalar names: the scalar constructor and numeric dtype classes only
    (no object dtype, so nothing but numbers can be built through them)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    kinds = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
             np.float16, np.float32, np.float64)
    return [core.multiarray.scalar, np.dtype, *(type(np.dtype(k)) for k in kinds)]


def load_dump(path: Path, start_index: int = 0) -> list[ForwardPass]:
    """One dump file -> its passes in run order, numbered from start_index."""
    # The file holds dicts, lists, ints, strings and tensors, which weights_only loads (plus numeric
    # numpy scalars, allowed by name: a later SGLang may leave a numpy int in a record); the map was
    # saved on the GPU, hence map_location. Never a full unpickle: anyone who can drop a file in the
    # record directory would run code in the server. A record with a type weights_only refuses means
    # an SGLang this reader does not know, and is reported as such.
    try:
        with torch.serialization.safe_globals(_numpy_scalar_globals()):
            data = torch.load(Path(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RecorderFormatError(
            f"{path}: holds objects a weights-only load refuses ({first_line}); not loaded (a full unpickle "
            "would run whatever code the file names)"
        ) from None
    if not isinstance(data, dict) or "records" not in data:
        raise RecorderFormatError(
            f"{path}: no 'records' list; was the engine started with expert_distribution_recorder_mode='per_token'?"
        )
    mapping = data.get("last_physical_to_logical_map")
    if mapping is not None:
        mapping = mapping.to(torch.int64)  # one map per dump, shared by its passes
    return [_parse(record, start_index + i, mapping, path) for i, record in enumerate(data["records"])]


def _parse(record: dict, index: int, mapping: torch.Tensor | None, path: Path) -> ForwardPass:
    missing = [k for k in _RECORD_KEYS if k not in record]
    if missing:
        raise RecorderFormatError(f"{path}: record {index} lacks {missing} (not a per_token record)")
    ids = record["topk_ids_of_layer"]
    n = len(record["input_ids"])
    if ids.dim() != 3 or ids.shape[1] != n or len(record["positions"]) != n:
        raise RecorderFormatError(
            f"{path}: record {index}: topk_ids_of_layer {tuple(ids.shape)} does not fit {n} tokens"
        )
    lens = record["extend_seq_lens"]
    physical = ids.to(torch.int32)
    return ForwardPass(
        index=index,
        mode=int(record["forward_mode"]),
        input_ids=tuple(int(t) for t in record["input_ids"]),
        positions=tuple(int(p) for p in record["positions"]),
        extend_seq_lens=None if lens is None else tuple(int(x) for x in lens),
        topk_ids=to_logical(physical, mapping),
        physical_ids=physical,
        physical_to_logical=mapping,
    )


def to_logical(ids: torch.Tensor, mapping: torch.Tensor | None) -> torch.Tensor:
    """Physical -> logical expert ids per layer ([L, n, 8]); -1 stays -1.

    Without EPLB redundancy the map is the identity, but with redundant experts two physical
    slots hold one logical expert, and the union must count that expert once.
    """
    if mapping is None or ids.numel() == 0:
        return ids
    mapping = mapping.to(torch.int64)  # [L, P]
    flat = ids.reshape(ids.shape[0], -1).to(torch.int64)  # [L, n*8]
    valid = (flat >= 0) & (flat < mapping.shape[1])
    logical = torch.gather(mapping, 1, flat.clamp(0, mapping.shape[1] - 1))
    return torch.where(valid, logical, torch.full_like(logical, -1)).reshape(ids.shape).to(torch.int32)


def dump_files(directory: Path, rank: int = 0) -> list[Path]:
    """Dump files of one rank in the order they were written (the name carries time.time())."""

    def written_at(p: Path) -> float:
        # expert_distribution_recorder_{time}_{rank}.pt
        return float(p.name.removeprefix("expert_distribution_recorder_").rsplit("_", 1)[0])

    return sorted(Path(directory).glob(DUMP_GLOB.format(rank=rank)), key=written_at)
