// AMX tile set-up shared by the kernels that use tiles (quant_gemm.cpp's matmuls, attention.cpp's prefill rows).
//
// Built where the compiler targets AMX (-march=native on Sapphire Rapids and later). Linux hands a process the
// tile data state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM); amx_granted() asks once. Each thread
// loads its own tile configuration before its first tile op and releases the tiles when its task ends
// (AmxTiles), so no tile state outlives a kernel call.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedserve {
namespace amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-5 with `rows` rows (C and A tiles), 6-7 with 16 (B tiles); every tile 64 bytes wide.
inline void configure(int rows) {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = static_cast<uint8_t>(i < 6 ? rows : 16);
    c.colsb[i] = 64;
  }
  // GCC 12 does not see ldtilecfg read the struct and drops the stores above without this barrier (seen here:
  // a zero configuration, then a #GP).
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// One task's tiles: configured on first use and whenever the row count changes, released at the end.
struct Tiles {
  int rows = 0;
  inline void use(int r) {
    if (r != rows) {
      configure(r);
      rows = r;
    }
  }
  Tiles() = default;
  explicit Tiles(int r) { use(r); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  ~Tiles() {
    if (rows) _tile_release();
  }
};

inline bool granted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

}  // namespace amx
}  // namespace pagedserve
#endif
