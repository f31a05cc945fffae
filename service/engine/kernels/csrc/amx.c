/* AMX arithmetic for the products over format-3 panels (math="amx", packed.py); matmul.c's
   matmul_panels calls it.

   Why: Intel Xeons from Sapphire Rapids on multiply bf16 tiles in the core's matrix unit (TDPBF16PS:
   16 rows x 16 columns x 32 products per instruction); a prefill, a batched step or a verify window
   of several positions is compute-bound in the vector tiles (bf16.c) and runs several times faster
   here, while a one-position step reads its weights at the same speed (measured on the panels below:
   64 columns x 256 inputs x 4,096 outputs, 1 / 4 / 16 rows: 1.03x / 2.6x / 6.0x the vector tiles).

   Arithmetic: x rounded to bf16 pairs as for format 2; each output is the tile unit's float32 sum over
   k (its own order of products and roundings, not VDPBF16PS's: outputs differ from format 2 in the
   last bits, ~1e-6 of their scale). Every row is computed on its own whatever else the tile holds, so
   rows stay independent (a row alone and in any pass: bitwise the same), which is what keeps greedy
   speculation == plain decoding; every product of a model reads one format, so every pass of every
   size takes this arithmetic.

   Layout: format 3 is format 2's panels ([ceil(Kd / 2), 64, 2] bf16: each column's weights for k and
   k + 1 side by side), which is the tile unit's B layout: 16 pair-rows x 16 columns are one tile at a
   stride of 256 bytes. The input size must be a multiple of 32 (packed.py packs other weights in
   format 2). Without AMX in the build (or without the kernel's permission: `amx_enable`) no weight is
   packed in format 3, so this code never runs. */
#include "kernels.h"

#include <stdint.h>
#include <string.h>

#if KERNELS_HAVE_AMX
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023  /* Linux: ask for a state component's permission */
#define XFEATURE_XTILEDATA 18       /* the tiles' data */

/* ldtilecfg's 64-byte operand, palette 1. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0-3: the 16-column quarters of a panel's outputs (rows x 64 bytes); 4: the rows' inputs
   (rows x 16 pairs); 5, 6: the weights (16 pair-rows x 16 columns), alternated so a load overlaps the
   previous product. */
static void tiles_for_rows(int64_t rows) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t <= 4; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
    for (int t = 5; t <= 6; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* Panels [p_begin, p_end) of a format-3 product for rows [0, N) of x, 16 rows per tile. */
KERNEL_PRIVATE void matmul_panels_amx(const float *x, int64_t N, int64_t Kd, const uint16_t *packed, int64_t C,
                                      int64_t p_begin, int64_t p_end, const float *bias, float *out) {
    const int64_t Kd2 = Kd / 2;
    uint32_t xp[16 * Kd2];
    float tile_out[16 * PANEL];
    int64_t configured = 0;
    for (int64_t t0 = 0; t0 < N; t0 += 16) {
        const int64_t rows = N - t0 < 16 ? N - t0 : 16;
        bf16_rows(x + t0 * Kd, rows, Kd, Kd2, (uint16_t *)xp);
        if (rows != configured) tiles_for_rows(rows), configured = rows;
        for (int64_t p = p_begin; p < p_end; p++) {
            const uint16_t *panel = packed + p * Kd2 * 2 * PANEL;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < Kd2; kb += 16) {
                const uint16_t *w = panel + kb * 2 * PANEL;  /* pair-row kb; a quarter is 32 bf16 further */
                _tile_loadd(4, xp + kb, Kd2 * 4);
                _tile_loadd(5, w, 2 * PANEL * 2);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, w + 32, 2 * PANEL * 2);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, w + 64, 2 * PANEL * 2);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, w + 96, 2 * PANEL * 2);
                _tile_dpbf16ps(3, 4, 6);
            }
            _tile_stored(0, tile_out, PANEL * 4);
            _tile_stored(1, tile_out + 16, PANEL * 4);
            _tile_stored(2, tile_out + 32, PANEL * 4);
            _tile_stored(3, tile_out + 48, PANEL * 4);
            const int64_t c0 = p * PANEL, valid = C - c0 < PANEL ? C - c0 : PANEL;
            for (int64_t t = 0; t < rows; t++)
                for (int64_t c = 0; c < valid; c++)
                    out[(t0 + t) * C + c0 + c] = tile_out[t * PANEL + c] + (bias ? bias[c0 + c] : 0.0f);
        }
    }
    _tile_release();  /* the tiles' state is large: a thread that holds none switches faster */
}

/* 1 when this build has the tile code and the kernel lets this process use the tiles (Linux grants
   them on request, once per process); 0 otherwise. */
int amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#else
int amx_enable(void) { return 0; }
#endif
