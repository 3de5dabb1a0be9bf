// The AMX set-up the C benchmarks here share (tile_costs.c, shared_route.c): ask Linux for the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM) and configure all eight tiles to 16 rows of 64 bytes (palette 1).
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

// 0 when the tiles are ready; else says why and returns 1.
static int amx_setup(void) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) {  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    printf("no AMX tile state granted\n");
    return 1;
  }
  struct {
    uint8_t palette, start;
    uint8_t res[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
  return 0;
}

// The four products of a 2 x 2 step: C tiles 0-3 += A tiles 4, 5 times B tiles 6, 7.
static inline __attribute__((always_inline)) void products_2x2(void) {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// A matmul's 2 x 2 step: B tiles 6, 7 streamed past L1 (TILELOADDT1, 64-byte rows) from b0, b1, A tiles 4, 5 from a0,
// a1 (row stride as bytes), then the four products.
static inline __attribute__((always_inline)) void step_2x2_streamed(const void* a0, const void* a1, int as,
                                                                   const void* b0, const void* b1) {
  _tile_stream_loadd(6, b0, 64);
  _tile_stream_loadd(7, b1, 64);
  _tile_loadd(4, a0, as);
  _tile_loadd(5, a1, as);
  products_2x2();
}
