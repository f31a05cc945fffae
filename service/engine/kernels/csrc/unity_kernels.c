/* The kernels' library (library.py) as one translation unit: `cc -I csrc ... unity_kernels.c`.

One unit, not one object per file: the helpers the files share are then static (linkage.h), so the
compiler inlines them across files (dot and exp512 into the MoE and attention loops, the tiles into
matmul_panels) and the library exports only its entry points.

The order is the files' dependency order, each after the files whose helpers it calls: the pool,
the shared helpers and tiles, bf16 and AMX arithmetic (which matmul_panels calls), the products and
rms_norm, then the kernels built on them, the layer loop over moe_block and attention_block, the
sampler, and last the whole short pass around it, and a draft head's greedy steps over both.
kernels.h declares every shared helper, so any order would compile; this one reads bottom-up. */
#define KERNEL_UNITY_BUILD

#include "kernel_pool.c"
#include "common.c"
#include "bf16.c"
#include "amx.c"
#include "matmul.c"
#include "moe.c"
#include "attention.c"
#include "head.c"
#include "head_tree.c"
#include "decoder.c"
#include "sampling.c"
#include "forward.c"
#include "spec_steps.c"
