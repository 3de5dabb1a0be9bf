// The GGUF block layouts the C++ GEMVs read: one table, checked against pagedserve/model/matmul.py's
// GGUF_BLOCK_LAYOUTS by tests/kernels (through the `gguf_block_layouts` binding).
//
// A block holds 32 weights: an fp16 scale d at byte 0, for Q4_1 an fp16 min m at byte 2, then the quants
// (Q4_0/Q4_1: 16 bytes of nibbles, low nibbles are weights 0-15; Q8_0: 32 int8).
#pragma once

#include <cstdint>

namespace pagedserve {

// ggml's type ids.
enum GgufType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

struct GgufLayout {
  int64_t type;
  const char* name;
  int64_t block_bytes;
  int64_t quant_offset;  // first quant byte
  int64_t quant_bytes;   // quant bytes per block
  int64_t min_offset;    // fp16 min, or -1 (none)
};

inline constexpr GgufLayout kGgufLayouts[] = {
    {kQ4_0, "Q4_0", 18, 2, 16, -1},
    {kQ4_1, "Q4_1", 20, 4, 16, 2},
    {kQ8_0, "Q8_0", 34, 2, 32, -1},
};

// The layout of a type id (block_bytes 0 for a type the GEMVs do not read).
constexpr GgufLayout gguf_layout(int64_t type) {
  for (const auto& l : kGgufLayouts) {
    if (l.type == type) return l;
  }
  return {type, "", 0, 0, 0, -1};
}

}  // namespace pagedserve
