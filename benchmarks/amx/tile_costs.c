// What AMX tile instructions cost on this machine (issue 17, twenty-fifth part): TDPBF16PS, TILELOADD / TILELOADDT1
// and TILESTORED alone, a 2 x 2 tile step (2 A + 2 B loads, 4 products: the matmuls' step) with its B tiles streamed
// from buffers of growing size (L1, L2, beyond), and the many-rows matmul's A-major loop over a decode step's rows
// (128 rows of x, K = 576, a fused SwiGLU group of 8 panels) with its variants; then (twenty-sixth part) that loop with
// vector work beside each step -- register FMAs, L1 loads and stores, stores to a buffer beyond L1 -- each also timed
// without the tile instructions, to see what overlaps the tile unit's work and what adds to it; and operands that cross
// between vector registers and tiles through L1 (a B tile written by vector stores, a C tile read by vector loads), read
// in the step that writes them or later.
//
//   gcc -O2 -march=native -o /tmp/tile_costs benchmarks/amx/tile_costs.c && /tmp/tile_costs [tsc_to_core]
//
// Cycles are TSC ticks times tsc_to_core (default 1.44: the ratio at which vfmadd231ps runs at 2 per cycle on the
// Sapphire Rapids VMs of these sessions; measure it on another machine). Needs AMX (Linux grants the tile state on
// request: arch_prctl ARCH_REQ_XCOMP_PERM).
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

#include "amx_setup.h"

static uint8_t l1buf[8][1024] __attribute__((aligned(64)));
static double k;  // core cycles per TSC tick
static volatile float sink;

static double since(unsigned long t0, double per) { return k * (double)(__rdtsc() - t0) / per; }

int main(int argc, char** argv) {
  k = argc > 1 ? atof(argv[1]) : 1.44;
  if (amx_setup()) return 1;
  memset(l1buf, 0, sizeof l1buf);
  const long n = 1000000;

  unsigned long t0 = __rdtsc();
  for (long i = 0; i < n; ++i) {
    products_2x2();
  }
  printf("TDPBF16PS, 4 independent accumulators     %6.1f cycles each\n", since(t0, 4.0 * n));
  t0 = __rdtsc();
  for (long i = 0; i < n; ++i) _tile_dpbf16ps(0, 4, 6);
  printf("TDPBF16PS, one accumulator (a chain)       %6.1f cycles each\n", since(t0, n));
  t0 = __rdtsc();
  for (long i = 0; i < n; ++i) {
    _tile_loadd(4, l1buf[0], 64);
    _tile_loadd(5, l1buf[1], 64);
    _tile_loadd(6, l1buf[2], 64);
    _tile_loadd(7, l1buf[3], 64);
  }
  printf("TILELOADD from L1                          %6.1f cycles each\n", since(t0, 4.0 * n));
  t0 = __rdtsc();
  for (long i = 0; i < n; ++i) _tile_stored(0, l1buf[0], 64);
  printf("TILESTORED                                 %6.1f cycles each\n", since(t0, n));
  t0 = __rdtsc();
  for (long i = 0; i < n; ++i) {
    _tile_loadd(4, l1buf[0], 64);
    _tile_loadd(6, l1buf[2], 64);
    _tile_loadd(5, l1buf[1], 64);
    _tile_loadd(7, l1buf[3], 64);
    products_2x2();
  }
  printf("2 x 2 step, all tiles from L1              %6.1f cycles per step (4 products)\n", since(t0, n));

  // Crossings through L1: a 2 x 2 step from L1 whose B tiles (one buffer per step, four in turn) were written by 16
  // vector stores `lag` steps before (0: in this step, just before the tile load), or whose C tile 0 is stored and read
  // back by 16 vector loads `lag` steps later.
  static uint8_t ring[4][2][1024] __attribute__((aligned(64)));
  static float cring[2][256] __attribute__((aligned(64)));
  printf("crossings between vectors and tiles (2 x 2 step from L1)        cycles per step\n");
  for (int v = 0; v < 7; ++v) {
    const char* what[] = {"none", "B written by vector stores, tile-loaded at once",
                          "B written by vector stores 1 step before", "B written by vector stores 2 steps before",
                          "16 vector stores no tile reads", "C stored, read by vector loads at once",
                          "C stored, read by vector loads 1 step later"};
    __m512 f = _mm512_set1_ps(1.f), g = _mm512_setzero_ps();
    t0 = __rdtsc();
    for (long i = 0; i < n; ++i) {
      const int lag = v == 2 ? 1 : v == 3 ? 2 : 0;
      if (v >= 1 && v <= 3)
        for (int q = 0; q < 16; ++q) _mm512_store_ps((float*)(ring[i & 3][0] + 64 * q), f);
      if (v == 4)
        for (int q = 0; q < 16; ++q) _mm512_store_ps((float*)(l1buf[7] + 64 * q), f);
      const int rb = v >= 1 && v <= 3 ? (int)((i - lag) & 3) : 0;
      _tile_loadd(6, ring[rb][0], 64);
      _tile_loadd(7, ring[rb][1], 64);
      _tile_loadd(4, l1buf[0], 64);
      _tile_loadd(5, l1buf[1], 64);
      products_2x2();
      if (v >= 5) {
        _tile_stored(0, cring[i & 1], 64);
        const float* rd = v == 5 ? cring[i & 1] : cring[(i + 1) & 1];
        for (int q = 0; q < 16; ++q) g = _mm512_add_ps(g, _mm512_load_ps(rd + 16 * q));
      }
    }
    printf("  %-56s %6.1f\n", what[v], since(t0, n));
    sink = _mm512_reduce_add_ps(g);  // keeps the loads live
  }

  // B tiles streamed through buffers of growing size; A from L1.
  const long sizes[] = {16 << 10, 256 << 10, 1 << 20, 1536 << 10, 8 << 20, 64 << 20};
  for (int si = 0; si < 6; ++si) {
    const long S = sizes[si], nb = S / 2048, steps = 4000000 / (si < 3 ? 1 : 4);
    uint8_t* big = aligned_alloc(4096, S);
    memset(big, 1, S);
    for (int v = 0; v < 2; ++v) {
      long j = 0;
      t0 = __rdtsc();
      for (long i = 0; i < steps; ++i) {
        const uint8_t* b = big + j * 2048;
        if (++j == nb) j = 0;
        if (v == 0) {
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 1024, 64);
        } else {
          _tile_stream_loadd(6, b, 64);
          _tile_stream_loadd(7, b + 1024, 64);
        }
        _tile_loadd(4, l1buf[0], 64);
        _tile_loadd(5, l1buf[1], 64);
        products_2x2();
      }
      printf("2 x 2 step, B streamed over %6ld KB (%s)  %6.1f cycles per step\n", S >> 10,
             v ? "TILELOADDT1" : "TILELOADD  ", since(t0, steps));
    }
    free(big);
  }

  // The A-major loop of quant_gemm_amx_rows at a decode step's rows: 128 rows of x (K = 576, row stride K), a group of
  // 8 widened panels (K * 16 bf16 each); per row pair and panel pair the C tiles over all of K, then stored.
  const int M = 128, K = 576, slots = 8;
  uint16_t* x = aligned_alloc(64, M * K * 2);
  uint16_t* wb = aligned_alloc(64, slots * K * 16 * 2);
  float* acc = aligned_alloc(64, M * 128 * 4);
  memset(x, 0, M * K * 2);
  memset(wb, 0, slots * K * 16 * 2);
  const char* names[] = {"as the kernel (B via TILELOADDT1, A rows K apart)", "B via TILELOADD",
                         "A tiles contiguous (rows 64 bytes apart)", "no C stores"};
  for (int v = 0; v < 4; ++v) {
    long steps = 0;
    t0 = __rdtsc();
    for (int rep = 0; rep < 2000; ++rep)
      for (int r0 = 0; r0 < M; r0 += 32)
        for (int j = 0; j < slots; j += 2) {
          const uint16_t *b0 = wb + j * K * 16, *b1 = b0 + K * 16, *x0 = x + r0 * K, *x1 = x0 + 16 * K;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int k0 = 0; k0 < K; k0 += 32, ++steps) {
            if (v == 1) {
              _tile_loadd(6, b0 + k0 * 16, 64);
              _tile_loadd(7, b1 + k0 * 16, 64);
            } else {
              _tile_stream_loadd(6, b0 + k0 * 16, 64);
              _tile_stream_loadd(7, b1 + k0 * 16, 64);
            }
            if (v == 2) {
              _tile_loadd(4, x0 + k0, 64);
              _tile_loadd(5, x0 + k0, 64);
            } else {
              _tile_loadd(4, x0 + k0, K * 2);
              _tile_loadd(5, x1 + k0, K * 2);
            }
            products_2x2();
          }
          if (v != 3) {
            float* cc = acc + r0 * 128 + j * 16;
            _tile_stored(0, cc, 512);
            _tile_stored(1, cc + 16, 512);
            _tile_stored(2, cc + 16 * 128, 512);
            _tile_stored(3, cc + 16 * 128 + 16, 512);
          }
        }
    printf("A-major loop, %-48s %6.1f cycles per step\n", names[v], since(t0, steps));
  }

  // The A-major loop with vector work after each step's four tile products (a matmul's side work: an epilogue, the
  // next group's widening), and the same loop without its tile instructions. FMAs on eight register chains; loads and
  // stores of 64 bytes; "beyond L1": a buffer of `far` bytes written in order (4 MB: L2 / L3; 64 MB: memory), or two
  // 64-byte lines per step 6,144 bytes apart (a 2,048 x 3,072 bf16 output's rows, as an item writes them).
  static float l1f[4096] __attribute__((aligned(64)));
  const long far_sizes[] = {4L << 20, 64L << 20};
  const char* side_names[] = {"nothing", "16 FMAs", "32 FMAs", "64 FMAs", "8 L1 loads + 8 FMAs", "2 L1 stores",
                              "8 L1 stores", "2 lines in order, far", "2 lines 6 KB apart, far", "8 lines in order, far"};
  for (int fi = 0; fi < 2; ++fi) {
    const long far = far_sizes[fi];
    uint8_t* fb = aligned_alloc(4096, far);
    memset(fb, 1, far);
    printf("side work beside each A-major step (far: %ld MB)       tiles + side   side alone\n", far >> 20);
    for (int v = 0; v < 10; ++v) {
      if (fi == 1 && v < 7) continue;  // the far size changes only the far cases
      double res[2];
      for (int tiles = 1; tiles >= 0; --tiles) {
        __m512 f0 = _mm512_set1_ps(1.f), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0;
        const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
        long steps = 0, pos = 0;
        t0 = __rdtsc();
        for (int rep = 0; rep < 500; ++rep)
          for (int r0 = 0; r0 < M; r0 += 32)
            for (int j = 0; j < slots; j += 2) {
              const uint16_t *b0 = wb + j * K * 16, *b1 = b0 + K * 16, *x0 = x + r0 * K, *x1 = x0 + 16 * K;
              if (tiles) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
              }
              for (int k0 = 0; k0 < K; k0 += 32, ++steps) {
                if (tiles) {
                  step_2x2_streamed(x0 + k0, x1 + k0, K * 2, b0 + k0 * 16, b1 + k0 * 16);
                }
#define FMA8 f0 = _mm512_fmadd_ps(f0, a, b); f1 = _mm512_fmadd_ps(f1, a, b); f2 = _mm512_fmadd_ps(f2, a, b); \
             f3 = _mm512_fmadd_ps(f3, a, b); f4 = _mm512_fmadd_ps(f4, a, b); f5 = _mm512_fmadd_ps(f5, a, b); \
             f6 = _mm512_fmadd_ps(f6, a, b); f7 = _mm512_fmadd_ps(f7, a, b);
                const long l = (steps * 8) & 255;
                float* p = (float*)(fb + pos);
                switch (v) {
                  case 1: FMA8 FMA8 break;
                  case 2: FMA8 FMA8 FMA8 FMA8 break;
                  case 3: FMA8 FMA8 FMA8 FMA8 FMA8 FMA8 FMA8 FMA8 break;
                  case 4:
                    f0 = _mm512_fmadd_ps(_mm512_load_ps(l1f + l * 16), a, f0);
                    f1 = _mm512_fmadd_ps(_mm512_load_ps(l1f + (l + 1) * 16), a, f1);
                    f2 = _mm512_fmadd_ps(_mm512_load_ps(l1f + (l + 2) * 16), a, f2);
                    f3 = _mm512_fmadd_ps(_mm512_load_ps(l1f + (l + 3) * 16), a, f3);
                    f4 = _mm512_fmadd_ps(_mm512_load_ps(l1f + (l + 4) * 16), a, f4);
                    f5 = _mm512_fmadd_ps(_mm512_load_ps(l1f + (l + 5) * 16), a, f5);
                    f6 = _mm512_fmadd_ps(_mm512_load_ps(l1f + (l + 6) * 16), a, f6);
                    f7 = _mm512_fmadd_ps(_mm512_load_ps(l1f + (l + 7) * 16), a, f7);
                    break;
                  case 5:
                    _mm512_store_ps(l1f + l * 16, f0);
                    _mm512_store_ps(l1f + (l + 1) * 16, f1);
                    break;
                  case 6:
                    _mm512_store_ps(l1f + l * 16, f0);
                    _mm512_store_ps(l1f + (l + 1) * 16, f1);
                    _mm512_store_ps(l1f + (l + 2) * 16, f2);
                    _mm512_store_ps(l1f + (l + 3) * 16, f3);
                    _mm512_store_ps(l1f + (l + 4) * 16, f4);
                    _mm512_store_ps(l1f + (l + 5) * 16, f5);
                    _mm512_store_ps(l1f + (l + 6) * 16, f6);
                    _mm512_store_ps(l1f + (l + 7) * 16, f7);
                    break;
                  case 7:
                    _mm512_store_ps(p, f0);
                    _mm512_store_ps(p + 16, f1);
                    pos = pos + 128 < far ? pos + 128 : 0;
                    break;
                  case 8:
                    _mm512_store_ps(p, f0);
                    _mm512_store_ps(p + 16, f1);
                    pos += 6144;
                    if (pos + 128 > far) pos = (pos + 128) % 6144;
                    break;
                  case 9:
                    for (int i = 0; i < 8; ++i) _mm512_store_ps(p + 16 * i, f0);
                    pos = pos + 512 < far ? pos + 512 : 0;
                    break;
                }
#undef FMA8
              }
              if (tiles) {
                float* cc = acc + r0 * 128 + j * 16;
                _tile_stored(0, cc, 512);
                _tile_stored(1, cc + 16, 512);
                _tile_stored(2, cc + 16 * 128, 512);
                _tile_stored(3, cc + 16 * 128 + 16, 512);
              }
            }
        res[tiles] = since(t0, steps);
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(f0, f1), _mm512_add_ps(f2, f3)),
                                         _mm512_add_ps(_mm512_add_ps(f4, f5), _mm512_add_ps(f6, f7)));
        sink = _mm512_reduce_add_ps(sum);  // keeps the chains live
      }
      printf("  %-30s                         %6.1f       %6.1f  cycles per step\n", side_names[v], res[1], res[0]);
    }
    free(fb);
  }
  _tile_release();
  return 0;
}
