// The many-rows AMX matmul's shared-weights route (quant_gemm.cpp, quant_gemm_amx_rows at prefill sizes) as a plain C
// loop on one thread, so that its memory pattern can be varied without rebuilding the extension (issue 17,
// twenty-sixth part): x [2,048 x 576] bf16, the weights already widened into a chunk of G groups of 4 panels (64
// output columns, K * 16 bf16 per panel), items of (a row block of MB rows, a group) row-block-major, each item's
// A-major 2 x 2 tile loop (A from L1, B via TILELOADDT1), its C tiles stored into acc and, optionally, written out as
// bf16 into y [2,048 x 3,072] (the plain 3,072-column matmul at W3's 2,048 rows). Prints cycles per 2 x 2 step.
//
//   gcc -O2 -march=native -o /tmp/shared_route benchmarks/amx/shared_route.c && /tmp/shared_route [tsc_to_core]
//
// Variants: the output not written / written per item as the kernel does (256 rows x 128 bytes, rows 6 KB apart) /
// staged per row block and copied out in whole rows; the next item's group asked into L2 during this item (4 lines
// per step); chunks of 28 groups (the kernel's 4 MB) or 14; row blocks of 128 / 256 / 512 rows. On the Sapphire
// Rapids of the twenty-sixth part it reproduced the kernel's 1-thread cost (~190 cycles per step; 66 is the tile
// products' own time) and no variant took more than ~15% off it.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

#include "amx_setup.h"

enum { M = 2048, K = 576, N = 3072, SLOTS = 4, GROUPS = N / 64, MAXG = 28, MAXMB = 512 };
static const long gsize = (long)SLOTS * K * 16;  // bf16 per group
static uint16_t *x, *wide, *y, *stage;
static float* acc;
static double k;  // core cycles per TSC tick

// write: 0 none, 1 per item (the kernel's), 2 staged per row block; pf: the next group into L2 during the item.
static double run(int write, int pf, int G, int MB) {
  const unsigned long t0 = __rdtsc();
  long steps = 0;
  for (int g0 = 0; g0 < GROUPS; g0 += G) {
    const int gn = GROUPS - g0 < G ? GROUPS - g0 : G;
    for (int m0 = 0; m0 < M; m0 += MB)
      for (int gi = 0; gi < gn; ++gi) {
        const uint16_t* buf = wide + gi * gsize;
        const char* next = (const char*)(wide + ((gi + 1) % gn) * gsize);
        long s = 0;  // step within the item
        for (int r0 = 0; r0 < MB; r0 += 32)
          for (int j = 0; j < SLOTS; j += 2) {
            const uint16_t *b0 = buf + j * K * 16, *b1 = b0 + K * 16, *x0 = x + (long)(m0 + r0) * K, *x1 = x0 + 16 * K;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int k0 = 0; k0 < K; k0 += 32, ++steps, ++s) {
              step_2x2_streamed(x0 + k0, x1 + k0, K * 2, b0 + k0 * 16, b1 + k0 * 16);
              if (pf && s * 256 < gsize * 2)
                for (int l = 0; l < 4; ++l) _mm_prefetch(next + s * 256 + 64 * l, _MM_HINT_T1);
            }
            float* cc = acc + r0 * 64 + j * 16;
            _tile_stored(0, cc, 256);
            _tile_stored(1, cc + 16, 256);
            _tile_stored(2, cc + 16 * 64, 256);
            _tile_stored(3, cc + 16 * 64 + 16, 256);
          }
        if (!write) continue;
        for (int r = 0; r < MB; ++r)
          for (int p = 0; p < 4; p += 2) {
            const __m512 a = _mm512_load_ps(acc + r * 64 + p * 16), b = _mm512_load_ps(acc + r * 64 + p * 16 + 16);
            const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            if (write == 1)
              _mm512_storeu_si512(y + (long)(m0 + r) * N + (g0 + gi) * 64 + p * 16, v);
            else
              _mm512_store_si512(stage + (long)r * gn * 64 + gi * 64 + p * 16, v);
          }
        if (write == 2 && gi == gn - 1)  // the row block's rows, whole
          for (int r = 0; r < MB; ++r)
            for (int c = 0; c < gn * 64; c += 32)
              _mm512_storeu_si512(y + (long)(m0 + r) * N + g0 * 64 + c,
                                  _mm512_load_si512(stage + (long)r * gn * 64 + c));
      }
  }
  return k * (double)(__rdtsc() - t0) / (double)steps;
}

int main(int argc, char** argv) {
  k = argc > 1 ? atof(argv[1]) : 1.44;
  if (amx_setup()) return 1;
  x = aligned_alloc(64, (long)M * K * 2);
  wide = aligned_alloc(64, (long)MAXG * gsize * 2);
  y = aligned_alloc(64, (long)M * N * 2);
  stage = aligned_alloc(64, (long)MAXMB * MAXG * 64 * 2);
  acc = aligned_alloc(64, (long)MAXMB * 64 * 4);
  for (long i = 0; i < (long)M * K; ++i) x[i] = 0x3f80;  // 1.0 in bf16
  for (long i = 0; i < (long)MAXG * gsize; ++i) wide[i] = 0x3f80;
  memset(y, 0, (long)M * N * 2);
  const char* writes[] = {"not written", "written per item", "staged, whole rows"};
  const int Gs[] = {28, 14}, MBs[] = {128, 256, 512};
  printf("output              next group  chunk  rows   cycles per step (two runs)\n");
  for (int w = 0; w < 3; ++w)
    for (int pf = 0; pf < 2; ++pf)
      for (int gi = 0; gi < 2; ++gi)
        for (int mi = 0; mi < 3; ++mi) {
          if (w == 2 && (pf || gi || mi != 1)) continue;
          const double a = run(w, pf, Gs[gi], MBs[mi]), b = run(w, pf, Gs[gi], MBs[mi]);
          printf("%-19s %-11s %5d  %5d   %6.1f %6.1f\n", writes[w], pf ? "into L2" : "-", Gs[gi], MBs[mi], a, b);
        }
  _tile_release();
  return 0;
}
