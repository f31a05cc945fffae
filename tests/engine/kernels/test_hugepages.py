"""`PanelArena`, the packed weights' memory: tensors of the asked shape and type, cache-line aligned,
that outlive the arena; in 2 MB pages where the system grants them (read back from /proc); and a
fused model's panels live there, bitwise the ordinary packing."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from service.engine.kernels.hugepages import HUGE_PAGE, PanelArena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)
    except (OSError, AttributeError):
        return None


def _huge_kb_around(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            mapping = int(head[1], 16) <= address < int(head[2], 16)
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def test_tensors_have_the_asked_shape_and_type_on_cache_lines_and_outlive_the_arena():
    arena = PanelArena(chunk_bytes=1 << 20)
    a = arena.empty((3, 5), torch.float32)
    b = arena.copy_of(torch.arange(7, dtype=torch.int64))
    big = arena.empty((3 << 20,), torch.uint8)  # more than a chunk: a mapping of its own
    assert a.shape == (3, 5) and a.dtype == torch.float32 and a.is_contiguous()
    assert all(t.data_ptr() % 64 == 0 for t in (a, b, big))
    assert big.data_ptr() % HUGE_PAGE == 0
    a.fill_(2.5)
    big.fill_(7)
    del arena
    gc.collect()
    assert torch.equal(b, torch.arange(7)) and bool((a == 2.5).all()) and int(big.sum()) == 7 * (3 << 20)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_the_memory_is_backed_by_huge_pages_where_the_system_grants_them():
    arena = PanelArena()
    weights = arena.empty((4 << 20,), torch.uint8)
    weights.fill_(1)  # touched: the pages are faulted in now
    assert _huge_kb_around(weights.data_ptr()) >= 4096


def test_a_fused_models_panels_live_in_its_arena_bitwise_the_ordinary_packing(k):
    from service.engine.model.ragged import KVCache
    from service.engine.model.weights import DEFAULT_TARGET_DIR, load_for_inference

    model = load_for_inference(DEFAULT_TARGET_DIR, kernels=k)
    packed = model.lm_head_packed.tensor
    assert packed.untyped_storage().nbytes() >= 8 << 20  # a view of an arena chunk, not a tensor of its own
    tokens = torch.randint(1, 4000, (6,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = model.forward(tokens, 0, KVCache(model.cfg, 16)).logits
    from service.engine.kernels.packed import PackedWeight

    plain = PackedWeight.pack(model.lm_head.weight.detach(), model.lm_head_packed.format)
    assert torch.equal(plain.tensor, packed)
    assert torch.isfinite(logits).all()
