// What AMX tile instructions cost on this machine (issue 17, twenty-fifth part): TDPBF16PS, TILELOADD / TILELOADDT1
// and TILESTORED alone, a 2 x 2 tile step (2 A + 2 B loads, 4 products: the matmuls' step) with its B tiles streamed
// from buffers of growing size (L1, L2, beyond), and the many-rows matmul's A-major loop over a decode step's rows
// (128 rows of x, K = 576, a fused SwiGLU group of 8 panels) with its variants.
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
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

struct cfg {
  uint8_t palette, start;
  uint8_t res[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static uint8_t l1buf[8][1024] __attribute__((aligned(64)));
static double k;  // core cycles per TSC tick

static double since(unsigned long t0, double per) { return k * (double)(__rdtsc() - t0) / per; }

int main(int argc, char** argv) {
  k = argc > 1 ? atof(argv[1]) : 1.44;
  if (syscall(SYS_arch_prctl, 0x1023, 18)) {
    printf("no AMX tile state granted\n");
    return 1;
  }
  struct cfg c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
  memset(l1buf, 0, sizeof l1buf);
  const long n = 1000000;

  unsigned long t0 = __rdtsc();
  for (long i = 0; i < n; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
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
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  printf("2 x 2 step, all tiles from L1              %6.1f cycles per step (4 products)\n", since(t0, n));

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
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
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
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
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
  _tile_release();
  return 0;
}
