"""Memory for a model's packed weights, in 2 MB pages where the operating system offers them.

Why: a decode step of the shipped model reads ~8.7 MB of weights spread over ~2,000 pages of 4 KB,
about as many as the CPU's translation cache (TLB) holds, so every step walked page tables for its
weights and evicted the translations of the interpreter's own work between two passes. In 2 MB
pages the same weights take a few dozen entries: on a 2-core Intel Xeon plain single-stream
decoding ran ~1.2x faster (interleaved with the same weights in ordinary pages; docs/engine.md).

How: `PanelArena` reserves anonymous private mappings advised MADV_HUGEPAGE (Linux transparent huge
pages in their common `madvise` mode) and hands out 64-byte aligned tensors carved from them, one
mapping per few megabytes, so the small weights of a layer share huge pages with the large ones.
Where the advice does not exist or the pages are not granted (another OS, THP off), the memory is
ordinary pages: the same bytes and the same results, only the speed differs.
"""

from __future__ import annotations

import mmap
from math import prod

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: every tensor starts on its own
CHUNK = 8 << 20  # a mapping holds several layers' small weights


class PanelArena:
    """A bump allocator over huge-page mappings; the tensors it returns keep their mapping alive."""

    def __init__(self, chunk_bytes: int = CHUNK):
        self.chunk_bytes = chunk_bytes
        self._space: torch.Tensor | None = None  # the current mapping's unused bytes (uint8, 2 MB aligned start)
        self.huge_pages_advised = hasattr(mmap, "MADV_HUGEPAGE")

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` and `dtype`."""
        nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        if self._space is None or self._space.numel() < need:
            self._space = self._map(max(self.chunk_bytes, -(-need // HUGE_PAGE) * HUGE_PAGE))
        block, self._space = self._space[:need], self._space[need:]
        return block[:nbytes].view(dtype).view(shape)

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `tensor` in the arena."""
        out = self.empty(tuple(tensor.shape), tensor.dtype)
        out.copy_(tensor)
        return out

    def _map(self, size: int) -> torch.Tensor:
        """`size` bytes starting on a 2 MB boundary (the mapping has one huge page of slack for that)."""
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self.huge_pages_advised:
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # THP compiled out: ordinary pages
                self.huge_pages_advised = False
        raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
        start = -raw.data_ptr() % HUGE_PAGE
        return raw[start:start + size]
