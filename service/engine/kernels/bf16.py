"""The C of bf16 arithmetic for the fused kernels' matrix products (math="bf16"; compiled into kernels.py's
library, whose PANEL, `bf16_value`, `STORE_TILE` and `TILE_ROWS` it uses, and which calls
`matmul_panels_bf16_math` for panels of format 2, see packed.py).

Why: a prefill is compute-bound (the float32 tiles run near this CPU's FMA rate) and batching cannot
make it cheaper; VDPBF16PS multiplies 32 bf16 pairs per instruction where float32 FMAs do 16. The
inputs are rounded to bf16 and the products summed in float32, each output in a fixed order whatever
else is in the pass, so rows stay independent (greedy speculation == plain decoding, batch-invariant
outputs) exactly as in float32. Without the instruction the same sums run as FMAs, bitwise alike.
"""

from service.engine.kernels import csrc

SOURCE = csrc.read("bf16.c")
