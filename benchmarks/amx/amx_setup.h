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
