// Matmuls and the embedding lookup straight from GGUF quantized blocks, for every row count, batch-invariant.
//
// A GGUF model's weights are these blocks; the float32 matrix W every reference computes with is what
// gguf-py's dequantize gives. Here no dense copy of W is kept: each kernel widens the blocks to exactly
// those float32 values (every product in the formulas below is exact in float32 -- an fp16 scale times
// integers of at most 13 bits together -- so only the final `+ m` / `- dmin * m` rounds, once, as in
// gguf-py) and multiplies with float32 activations. Every output is ONE float32 FMA chain, as
// fixed_gemm.cpp's fixed_linear:
//   acc = 0; for k = 0 .. K-1: acc = fma(x[m, k], W[n, k], acc);  y[m, n] = acc (+ bias[n])
// so quant_linear(x, quant_pack(raw)) is bit-identical to fixed_linear(x, fixed_pack(dequantize(raw)))
// whatever M is, which row m is and how many threads run.
//
// Packed layout (quant_pack): one uint8 tensor [ceil(N / 16), 16 * row_bytes]. Panel p holds rows
// 16p .. 16p+15 (rows past N are zero bytes, which decode to 0: the only overhead, under 16 rows of the
// file's bytes). Within a panel, GGUF block b of the 16 rows is 16 * block_bytes bytes, its fields
// regrouped so that one 16-byte load gives a byte of every row (one vector lane per output row):
// fp16 fields (d, m, dmin) as 16 consecutive halves, every other field "byte-planar": byte j of the
// field for row r at field_offset + 16 * j + r. The bytes are the file's bytes, only moved: the 6-bit
// K-quant scales are unpacked in the kernels. (kQuantTypes lists each type's fields.) The bf16 route also reads Q4_0 /
// Q4_1 packed lane-local (quant_relayout, where VBMI is built; type ids kQ4_0L / kQ4_1L): each block's quant bytes
// regrouped so that its widening needs no byte permute (packed_index, FastPairs::lanes4); the model does this at
// load for weights that no other route reads (model/matmul.py, MatmulRoutes._regroup).
//
// Kernels. Few rows (M <= 4, decode; bound by reading and widening the weights): a GEMV that widens one k of 16
// rows at a time in registers (one 16-byte load, a few integer ops, two int -> float conversions and the scale
// multiplies) straight into the FMAs, over 1-2 panels at once so that 4-8 independent chains hide the FMA latency,
// with software prefetch ahead of the panel streams. Many rows (prefill; compute-bound): per block of ~256 KB of x
// rows (up to 264 rows: all of them), each panel's weights are widened one 256-k slice at a time into a 16 KB float32
// buffer [k][16 rows] (L1-resident) that 6-row x 16-column register tiles (fixed_gemm.cpp's scheme) run over; the
// chains continue across slices through stored accumulators (stored and reloaded exactly). Threads split the panels;
// an output is computed by one thread from k = 0 to K-1.
//
// AVX2 + FMA + F16C intrinsics (FMAs opaque to -ffast-math's reassociation; the decode's arithmetic is
// exact products and one add, so contraction or reordering cannot change it); without them a scalar path
// (std::fma, the same chains; few rows run the many-rows scheme there) gives the same bits. Nothing
// beyond AVX2 is used, so an AVX-512 build (-march=native) runs these same kernels.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "ops.h"

// AMX tiles for quant_linear_bf16 (built only where its vdpbf16ps route is too: see there).
#include "amx.h"
#if defined(PAGEDSERVE_QUANT_AVX2) && defined(__AVX512BW__) && defined(PAGEDSERVE_AMX)
#define PAGEDSERVE_QUANT_AMX 1
#endif

namespace pagedserve {
// The internals live in their own namespace: gguf_layouts.h's pagedserve::kQ4_0 ... must not collide with
// these where both are seen (bindings.cpp compiles this file, see there).
namespace quant_detail {
namespace {

// ---- the block formats -------------------------------------------------------------------------------

// One field of a GGUF block: `len` bytes at raw_off in the file's block, regrouped for 16 rows at
// packed_off of the packed block: fp16 fields row after row (packed_off + 2 r), others byte-planar.
struct Field {
  int16_t raw_off, len, packed_off;
  bool planar;
  bool lanes = false;  // planar bytes regrouped lane-local (the bf16 route's Q4_0 / Q4_1: see packed_index)
};

struct QuantType {
  int64_t id;
  const char* name;
  int64_t block_size;   // weights per block
  int64_t block_bytes;  // bytes per block in the file (and per row in a packed block)
  int nfields;
  Field f[5];
};

// ggml type ids (gguf.GGMLQuantizationType). Packed offsets: see the decoders below.
enum : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// The lane-local packing of Q4_0 / Q4_1 (quant_relayout; read by the bf16 route only, where the build has VBMI): the
// same blocks with each block's quant bytes regrouped (packed_index), under these ids (not ggml's: kLanes | its id).
enum : int64_t { kLanes = 0x100, kQ4_0L = kLanes | kQ4_0, kQ4_1L = kLanes | kQ4_1 };
constexpr int64_t base_type(int64_t id) { return id & ~kLanes; }

constexpr QuantType kQuantTypes[] = {
    {kQ4_0, "Q4_0", 32, 18, 2, {{0, 2, 0, false}, {2, 16, 32, true}}},                      // d, qs
    {kQ4_1, "Q4_1", 32, 20, 3, {{0, 2, 0, false}, {2, 2, 32, false}, {4, 16, 64, true}}},  // d, m, qs
    {kQ5_0, "Q5_0", 32, 22, 3, {{0, 2, 0, false}, {2, 4, 32, true}, {6, 16, 96, true}}},   // d, qh, qs
    {kQ5_1, "Q5_1", 32, 24, 4, {{0, 2, 0, false}, {2, 2, 32, false}, {4, 4, 64, true}, {8, 16, 128, true}}},
    {kQ8_0, "Q8_0", 32, 34, 2, {{0, 2, 0, false}, {2, 32, 32, true}}},  // d, qs
    // d, dmin, scales (12), qs (128)
    {kQ4_K, "Q4_K", 256, 144, 4, {{0, 2, 0, false}, {2, 2, 32, false}, {4, 12, 64, true}, {16, 128, 256, true}}},
    // d, dmin, scales (12), qh (32), qs (128)
    {kQ5_K, "Q5_K", 256, 176, 5,
     {{0, 2, 0, false}, {2, 2, 32, false}, {4, 12, 64, true}, {16, 32, 256, true}, {48, 128, 768, true}}},
    // file: ql (128), qh (64), scales (16 int8), d; packed: d, scales, ql, qh
    {kQ6_K, "Q6_K", 256, 210, 4, {{208, 2, 0, false}, {192, 16, 32, true}, {0, 128, 288, true}, {128, 64, 2336, true}}},
    // lane-local: the quants' bytes regrouped
    {kQ4_0L, "Q4_0 (lane-local)", 32, 18, 2, {{0, 2, 0, false}, {2, 16, 32, true, true}}},
    {kQ4_1L, "Q4_1 (lane-local)", 32, 20, 3, {{0, 2, 0, false}, {2, 2, 32, false}, {4, 16, 64, true, true}}},
};

constexpr QuantType quant_type(int64_t id) {
  for (const auto& t : kQuantTypes) {
    if (t.id == id) return t;
  }
  return {id, "", 0, 0, 0, {}};
}

const QuantType& checked_type(int64_t id, const char* what) {
  for (const auto& t : kQuantTypes) {
    if (t.id == id) return t;
  }
  TORCH_CHECK(false, what, ": ggml type ", id, " is not one of the quantized types read in place");
  return kQuantTypes[0];
}

#ifdef PAGEDSERVE_AVX512
// The mask of the first n of 16 lanes (all of them for n >= 16).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1u);
}
#endif

// The size of quant_screen_i8_norms' tensor for `panels` panels of nb 32-k blocks: the per-panel block sums, then per
// 16 panels each block's panel maxima.
inline int64_t i8_norms_size(int64_t panels, int64_t nb) { return (panels + (panels + 15) / 16) * nb * 16; }

// Byte j of field f of row r within a packed block. Lane-local (16 planes of 16 rows): four 64-byte groups -- (planes
// 0-7, rows 0-7), (planes 0-7, rows 8-15), (planes 8-15, rows 0-7), (planes 8-15, rows 8-15) -- and in a group byte s
// of dword lane l is row l / 2's byte of plane 2 s + l % 2, so that a 16-lane float vector of (row, k) pairs finds
// each lane's quant in that lane (FastPairs::lanes4).
inline int64_t packed_index(const Field& f, int64_t j, int64_t r) {
  if (f.lanes) return f.packed_off + ((j / 8) * 2 + r / 8) * 64 + (2 * (r % 8) + j % 2) * 4 + (j % 8) / 2;
  return f.planar ? f.packed_off + j * 16 + r : f.packed_off + r * f.len + j;
}

// The file's block of row r (of 16) out of a packed block, and back.
inline void gather_row(const QuantType& t, const uint8_t* pb, int64_t r, uint8_t* blk) {
  for (int i = 0; i < t.nfields; ++i)
    for (int64_t j = 0; j < t.f[i].len; ++j) blk[t.f[i].raw_off + j] = pb[packed_index(t.f[i], j, r)];
}
inline void scatter_row(const QuantType& t, const uint8_t* blk, uint8_t* pb, int64_t r) {
  for (int i = 0; i < t.nfields; ++i)
    for (int64_t j = 0; j < t.f[i].len; ++j) pb[packed_index(t.f[i], j, r)] = blk[t.f[i].raw_off + j];
}

// ---- scalar dequantization of one file block (gguf-py's quants.py, operation by operation) ------------

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  uint32_t u;
  if (e == 0) {  // zero or subnormal: mant * 2^-24, exact in float32
    const float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else if (e == 31) {
    u = sign | 0x7F800000u | (mant << 13);
  } else {
    u = sign | ((e + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Q4_K/Q5_K's 6-bit scale and min of sub-block s (quants.py: Q4_K.get_scale_min).
inline void k_scale_min(const uint8_t* sc, int s, int& scale, int& mn) {
  if (s < 4) {
    scale = sc[s] & 0x3F;
    mn = sc[s + 4] & 0x3F;
  } else {
    scale = (sc[s + 4] & 0x0F) | ((sc[s - 4] >> 2) & 0x30);
    mn = (sc[s + 4] >> 4) | ((sc[s] >> 2) & 0x30);
  }
}

template <int64_t T>
void dequant_block(const uint8_t* b, float* out) {
  if constexpr (T == kQ4_0 || T == kQ4_1) {
    const float d = half_to_float(b);
    const uint8_t* qs = b + (T == kQ4_0 ? 2 : 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
      if constexpr (T == kQ4_0) {
        out[j] = d * static_cast<float>(lo - 8);
        out[j + 16] = d * static_cast<float>(hi - 8);
      } else {
        const float m = half_to_float(b + 2);
        out[j] = d * static_cast<float>(lo) + m;
        out[j + 16] = d * static_cast<float>(hi) + m;
      }
    }
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    const float d = half_to_float(b);
    const uint8_t* qhp = b + (T == kQ5_0 ? 2 : 4);
    const uint8_t* qs = qhp + 4;
    const uint32_t qh = static_cast<uint32_t>(qhp[0]) | (static_cast<uint32_t>(qhp[1]) << 8) |
                        (static_cast<uint32_t>(qhp[2]) << 16) | (static_cast<uint32_t>(qhp[3]) << 24);
    for (int j = 0; j < 32; ++j) {
      const int lo = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
      const int q = lo | static_cast<int>(((qh >> j) & 1u) << 4);
      if constexpr (T == kQ5_0) {
        out[j] = d * static_cast<float>(q - 16);
      } else {
        out[j] = d * static_cast<float>(q) + half_to_float(b + 2);
      }
    }
  } else if constexpr (T == kQ8_0) {
    const float d = half_to_float(b);
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* sc = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (T == kQ4_K ? 16 : 48);
    for (int s = 0; s < 8; ++s) {
      int scale, mn;
      k_scale_min(sc, s, scale, mn);
      const float ds = d * static_cast<float>(scale), dm = dmin * static_cast<float>(mn);
      for (int i = 0; i < 32; ++i) {
        int q = (qs[(s / 2) * 32 + i] >> (4 * (s & 1))) & 0x0F;
        if constexpr (T == kQ5_K) q |= ((qh[i] >> s) & 1) << 4;
        out[s * 32 + i] = ds * static_cast<float>(q) - dm;
      }
    }
  } else {  // Q6_K
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    for (int w = 0; w < 256; ++w) {
      const int lo = (ql[(w / 128) * 64 + w % 64] >> (4 * ((w / 64) % 2))) & 0x0F;
      const int hi = (qh[(w / 128) * 32 + w % 32] >> (2 * ((w / 32) % 4))) & 0x03;
      const float ds = d * static_cast<float>(sc[w / 16]);
      out[w] = ds * static_cast<float>((lo | (hi << 4)) - 32);
    }
  }
}

// Fully unrolled before GCC scalarizes the accumulator arrays: without it GCC 12 keeps them in memory and
// stores every accumulator at every k step (measured: 2.5x slower tiles).
#define PAGEDSERVE_UNROLL _Pragma("GCC unroll 32")

// ---- widening a 32-k sub-block of a packed block: out[i * 16 + r] = W[row r, k0 + i] ------------------

#ifdef PAGEDSERVE_QUANT_AVX2
inline __m128i ld(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline void halves(const uint8_t* p, __m256& lo, __m256& hi) {  // 16 fp16 values
  lo = _mm256_cvtph_ps(ld(p));
  hi = _mm256_cvtph_ps(ld(p + 16));
}
inline __m256 u8lo(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 u8hi(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v))); }
inline __m256 i8lo(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
inline __m256 i8hi(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v))); }
// The low (hi false) or high nibbles of 8 rows' bytes at p, as floats: zero-extended straight from memory into
// dword lanes, then masked or shifted. Two lane-crossing shuffles per 16 rows where u8lo / u8hi of a 16-byte load
// take three: on Zen 3 (AVX2) the few-rows float32 GEMV is bound by its shuffles, and this form runs Q4_0 / Q4_1 /
// Q4_K 1.3-1.45x faster at 1 row (the same weights).
inline __m256 nibbles8(const uint8_t* p, bool hi) {
  const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(hi ? _mm256_srli_epi32(z, 4) : _mm256_and_si256(z, _mm256_set1_epi32(0x0F)));
}
inline __m128i bytes(int v) { return _mm_set1_epi8(static_cast<char>(v)); }
// 8 signed bytes at p as floats (sign-extended straight from memory).
inline __m256 sbytes8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void store_pair(int8_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
inline __m256i ld256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// (v >> sh) & 0xF per byte.
inline __m128i nibble(__m128i v, int sh) { return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(sh)), bytes(0x0F)); }
// Q4_K/Q5_K's 6-bit scale and min of sub-block s for the 16 rows (k_scale_min on 16 lanes): S is the packed
// block's 12 planar scale bytes.
inline void k_scale_min16(const uint8_t* S, int s, __m128i& sc, __m128i& mn) {
  if (s < 4) {
    sc = _mm_and_si128(ld(S + s * 16), bytes(0x3F));
    mn = _mm_and_si128(ld(S + (s + 4) * 16), bytes(0x3F));
  } else {
    const __m128i hi4 = ld(S + (s + 4) * 16);
    sc = _mm_or_si128(_mm_and_si128(hi4, bytes(0x0F)),
                      _mm_and_si128(_mm_srli_epi16(ld(S + (s - 4) * 16), 2), bytes(0x30)));
    mn = _mm_or_si128(nibble(hi4, 4), _mm_and_si128(_mm_srli_epi16(ld(S + s * 16), 2), bytes(0x30)));
  }
}
inline void put(float* o, __m256 a, __m256 b) {
  _mm256_storeu_ps(o, a);
  _mm256_storeu_ps(o + 8, b);
}

// The quant bytes of a 32-block type's packed block for the 16 rows, qb[k * 16 + r], two k per instruction: qs its 16
// quant planes (byte i of a row: weight i's nibble, weight 16 + i's above it), qh its 4 fifth-bit planes (bit k % 8 of
// plane k / 8: weight k's), Set / Clear or'ed in where weight k's fifth bit is set / clear (both 0: no fifth bit).
template <int Set, int Clear>
inline void nibble_bytes(const uint8_t* qs, const uint8_t* qh, int8_t* qb) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  PAGEDSERVE_UNROLL
  for (int i = 0; i < 16; i += 2) {  // planes i, i + 1: k = i, i + 1 (low nibbles) and 16 + i, 17 + i (high)
    const __m256i v = ld256(qs + i * 16);
    __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
    if constexpr (Set != 0 || Clear != 0) {
      const __m256i m = _mm256_setr_m128i(_mm_set1_epi8(static_cast<char>(1 << (i % 8))),
                                          _mm_set1_epi8(static_cast<char>(1 << (i % 8 + 1))));
      const auto fifth = [&](__m256i u, int plane) {  // plane broadcast to both halves; 0xFF where the bit is set
        const __m256i f = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_broadcastsi128_si256(ld(qh + plane * 16)), m), m);
        if constexpr (Set != 0) u = _mm256_or_si256(u, _mm256_and_si256(f, _mm256_set1_epi8(static_cast<char>(Set))));
        if constexpr (Clear != 0)
          u = _mm256_or_si256(u, _mm256_andnot_si256(f, _mm256_set1_epi8(static_cast<char>(Clear))));
        return u;
      };
      lo = fifth(lo, i / 8);
      hi = fifth(hi, 2 + i / 8);
    }
    store_pair(qb + i * 16, lo);
    store_pair(qb + (16 + i) * 16, hi);
  }
}

// The quant bytes of a K-quant sub-block for the 16 rows, qb[k * 16 + r] (two k per instruction): the nibble at nsh of
// ql's plane k, or'ed with qh's plane k moved from bit `bit` to bit 4 (one shift) and masked (Mask: Q5_K's one high
// bit, Q6_K's two), minus Off.
template <int Mask, int Off>
inline void nibble_high_bytes(const uint8_t* ql, const uint8_t* qh, int nsh, int bit, int8_t* qb) {
  const __m128i n = _mm_cvtsi32_si128(nsh), up = _mm_cvtsi32_si128(4 - bit), down = _mm_cvtsi32_si128(bit - 4);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), mask = _mm256_set1_epi8(Mask);
  PAGEDSERVE_UNROLL
  for (int k = 0; k < 32; k += 2) {
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ld256(ql + k * 16), n), lo4);
    const __m256i hv = ld256(qh + k * 16);
    __m256i u = _mm256_or_si256(lo, _mm256_and_si256(bit <= 4 ? _mm256_sll_epi16(hv, up) : _mm256_srl_epi16(hv, down),
                                                      mask));
    if constexpr (Off != 0) u = _mm256_sub_epi8(u, _mm256_set1_epi8(Off));
    store_pair(qb + k * 16, u);
  }
}

// The weights of one k (i of a 32-k sub-block s) for the 16 rows of a packed block, as two float32 vectors
// (rows 0-7, 8-15). init() reads the sub-block's scales once; get<HI>(i) widens k = i (HI: k = 16 + i).
// The byte form (kBytes): init assembles the sub-block's quants as bytes (qb[k * 16 + r], 32 per instruction) and get
// sign-extends 8 straight from memory (vpmovsxbd m64) -- the 5- and 6-bit types always (in registers their quants took
// 6-8 ops per 8 weights: 1.44x / 1.46x at 1 row for Q5_0 / Q6_K on a Zen 3), Q4_0 / Q4_1 only in the few-rows GEMV
// (Few: one op less per 8 weights, 1.03-1.07x at 1-4 rows; widen_sub's float buffer pays the stores, 0.98x). Q4_K
// keeps nibbles8 (the byte form measured no gain) and Q8_0's quants are bytes already.
template <int64_t T, bool Few = false>
struct Widen {
  static constexpr bool kBytes =
      T == kQ5_0 || T == kQ5_1 || T == kQ5_K || T == kQ6_K || (Few && (T == kQ4_0 || T == kQ4_1));
  const uint8_t* q;  // the quant plane of the sub-block (Q8_0, Q4_K, Q4_0 / Q4_1 without the byte form)
  int sh;            // Q4_K's nibble shift
  alignas(32) int8_t qb[kBytes ? 512 : 1];
  __m256 a0, a1, b0, b1;  // d (or d * scale), and m (or -8 d, or dmin * min, or Q6_K's second scale)

  inline void init(const uint8_t* pb, int s) {
    halves(pb, a0, a1);
    if constexpr (T == kQ8_0) {
      q = pb + 32;
    } else if constexpr (T == kQ4_0) {  // -8 d (exact)
      b0 = _mm256_mul_ps(a0, _mm256_set1_ps(-8.f));
      b1 = _mm256_mul_ps(a1, _mm256_set1_ps(-8.f));
      q = pb + 32;
    } else if constexpr (T == kQ5_0) {  // q - 16 as a byte: nibble | 0xF0 where the fifth bit is clear
      nibble_bytes<0, 0xF0>(pb + 96, pb + 32, qb);
    } else if constexpr (T == kQ4_1 || T == kQ5_1) {  // Q5_1: q as a byte, nibble | 0x10 if set
      halves(pb + 32, b0, b1);
      q = pb + (T == kQ4_1 ? 64 : 128);
      if constexpr (T == kQ5_1) nibble_bytes<0x10, 0>(q, pb + 64, qb);
    } else if constexpr (T == kQ4_K || T == kQ5_K) {
      __m256 m0, m1;
      halves(pb + 32, m0, m1);
      const uint8_t* S = pb + 64;  // the 12 scale bytes, planar
      __m128i sc, mn;
      k_scale_min16(S, s, sc, mn);
      b0 = _mm256_mul_ps(m0, u8lo(mn));  // dmin * min
      b1 = _mm256_mul_ps(m1, u8hi(mn));
      a0 = _mm256_mul_ps(a0, u8lo(sc));  // d * scale
      a1 = _mm256_mul_ps(a1, u8hi(sc));
      q = pb + (T == kQ4_K ? 256 : 768) + (s / 2) * 32 * 16;
      sh = 4 * (s & 1);
      if constexpr (T == kQ5_K) nibble_high_bytes<0x10, 0>(q, pb + 256, sh, s, qb);  // q: the nibble | bit s of qh
    } else {  // Q6_K: k = 32 s + i has scale 2 s (i < 16) or 2 s + 1
      const __m128i sa = ld(pb + 32 + (2 * s) * 16), sb = ld(pb + 32 + (2 * s + 1) * 16);
      b0 = _mm256_mul_ps(a0, i8lo(sb));
      b1 = _mm256_mul_ps(a1, i8hi(sb));
      a0 = _mm256_mul_ps(a0, i8lo(sa));
      a1 = _mm256_mul_ps(a1, i8hi(sa));
      // q - 32: ql's nibble | qh's 2 bits at 2 (s % 4), moved to bits 4-5
      nibble_high_bytes<0x30, 32>(pb + 288 + ((s / 4) * 64 + (s % 2) * 32) * 16, pb + 2336 + (s / 4) * 32 * 16,
                                  4 * ((s / 2) % 2), 2 * (s % 4), qb);
    }
    if constexpr (kBytes && (T == kQ4_0 || T == kQ4_1)) nibble_bytes<0, 0>(q, nullptr, qb);
  }

  template <bool HI>
  inline void get(int i, __m256& w0, __m256& w1) const {
    const int k = HI ? 16 + i : i;
    const int8_t* b = qb + k * 16;
    if constexpr (T == kQ8_0) {  // two 8-byte loads straight into vpmovsxbd (no shuffle for the high half)
      const __m128i v0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 16));
      const __m128i v1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 16 + 8));
      w0 = _mm256_mul_ps(i8lo(v0), a0);
      w1 = _mm256_mul_ps(i8lo(v1), a1);
    } else if constexpr (T == kQ4_0 || T == kQ4_1) {
      // byte i of a row holds weight i (low nibble) and 16 + i (high). d q + m, or Q4_0's d (q - 8) as fma(q, d,
      // -8 d): d q and 8 d are exact, so is their difference, the product the reference rounds.
      w0 = _mm256_fmadd_ps(a0, kBytes ? sbytes8(b) : nibbles8(q + i * 16, HI), b0);
      w1 = _mm256_fmadd_ps(a1, kBytes ? sbytes8(b + 8) : nibbles8(q + i * 16 + 8, HI), b1);
    } else if constexpr (T == kQ5_0) {  // d (q - 16), exact
      w0 = _mm256_mul_ps(a0, sbytes8(b));
      w1 = _mm256_mul_ps(a1, sbytes8(b + 8));
    } else if constexpr (T == kQ5_1) {  // d * q + m
      w0 = _mm256_add_ps(_mm256_mul_ps(a0, sbytes8(b)), b0);
      w1 = _mm256_add_ps(_mm256_mul_ps(a1, sbytes8(b + 8)), b1);
    } else if constexpr (T == kQ4_K) {  // d * scale * q - dmin * min
      w0 = _mm256_fmsub_ps(a0, nibbles8(q + k * 16, sh != 0), b0);
      w1 = _mm256_fmsub_ps(a1, nibbles8(q + k * 16 + 8, sh != 0), b1);
    } else if constexpr (T == kQ5_K) {  // d * scale * q - dmin * min
      w0 = _mm256_sub_ps(_mm256_mul_ps(a0, sbytes8(b)), b0);
      w1 = _mm256_sub_ps(_mm256_mul_ps(a1, sbytes8(b + 8)), b1);
    } else {  // Q6_K: d * scale * (q - 32)
      w0 = _mm256_mul_ps(HI ? b0 : a0, sbytes8(b));
      w1 = _mm256_mul_ps(HI ? b1 : a1, sbytes8(b + 8));
    }
  }
};

template <int64_t T>
inline void widen_sub(const uint8_t* pb, int s, float* out) {
  Widen<T> wd;
  wd.init(pb, s);
  __m256 w0, w1;
  for (int i = 0; i < 16; ++i) {
    wd.template get<false>(i, w0, w1);
    put(out + i * 16, w0, w1);
  }
  for (int i = 0; i < 16; ++i) {
    wd.template get<true>(i, w0, w1);
    put(out + (16 + i) * 16, w0, w1);
  }
}
#else
template <int64_t T>
inline void widen_sub(const uint8_t* pb, int s, float* out) {
  constexpr QuantType t = quant_type(T);
  uint8_t blk[t.block_bytes];
  float vals[t.block_size];
  for (int64_t r = 0; r < 16; ++r) {
    gather_row(t, pb, r, blk);
    dequant_block<T>(blk, vals);
    for (int i = 0; i < 32; ++i) out[i * 16 + r] = vals[s * 32 + i];
  }
}
#endif

// W[rows of panel, k0 .. k0 + kc) into out[(k - k0) * 16 + r]; k0 and kc are multiples of 32.
template <int64_t T>
inline void widen_range(const uint8_t* panel, int64_t k0, int64_t kc, float* out) {
  constexpr QuantType t = quant_type(T);
  constexpr int64_t pbb = 16 * t.block_bytes;
  for (int64_t k = k0; k < k0 + kc; k += 32)
    widen_sub<T>(panel + (k / t.block_size) * pbb, static_cast<int>((k % t.block_size) / 32), out + (k - k0) * 16);
}

// ---- the register tile ----------------------------------------------------------------------------------

// acc[r * as + p * 16 + j] (+)= chain over k < kc of x[r * xs + k] * buf[(p * kc + k) * 16 + j], for R rows
// and P panels of 16 columns: the same fma(x, w, acc) steps as fixed_gemm.cpp's tile. FIRST: start the
// chains at 0, else continue them from acc (a template parameter, so the accumulators stay in registers).
template <int R, int P, bool FIRST>
inline void qtile(const float* x, int64_t xs, const float* buf, int64_t kc, float* acc, int64_t as) {
#ifdef PAGEDSERVE_QUANT_AVX2
  __m256 c0[R * P], c1[R * P];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) {
    if constexpr (FIRST) {
      c0[i] = c1[i] = _mm256_setzero_ps();
    } else {
      c0[i] = _mm256_loadu_ps(acc + (i / P) * as + (i % P) * 16);
      c1[i] = _mm256_loadu_ps(acc + (i / P) * as + (i % P) * 16 + 8);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    PAGEDSERVE_UNROLL
    for (int p = 0; p < P; ++p) {
      const float* w = buf + (p * kc + k) * 16;
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
      PAGEDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * xs + k);
        c0[r * P + p] = _mm256_fmadd_ps(a, w0, c0[r * P + p]);
        c1[r * P + p] = _mm256_fmadd_ps(a, w1, c1[r * P + p]);
      }
    }
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) {
    _mm256_storeu_ps(acc + (i / P) * as + (i % P) * 16, c0[i]);
    _mm256_storeu_ps(acc + (i / P) * as + (i % P) * 16 + 8, c1[i]);
  }
#else
  if constexpr (FIRST)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < P * 16; ++j) acc[r * as + j] = 0.f;
  for (int64_t k = 0; k < kc; ++k)
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < 16; ++j)
          acc[r * as + p * 16 + j] = std::fma(x[r * xs + k], buf[(p * kc + k) * 16 + j], acc[r * as + p * 16 + j]);
#endif
}

template <int R, int P>
inline void qtile_f(bool first, const float* x, int64_t xs, const float* buf, int64_t kc, float* acc, int64_t as) {
  if (first) {
    qtile<R, P, true>(x, xs, buf, kc, acc, as);
  } else {
    qtile<R, P, false>(x, xs, buf, kc, acc, as);
  }
}

template <int R>
inline void qtile_p(int P, bool first, const float* x, int64_t xs, const float* buf, int64_t kc, float* acc,
                    int64_t as) {
  switch (P) {
    case 1: qtile_f<R, 1>(first, x, xs, buf, kc, acc, as); break;
    case 2: qtile_f<R, 2>(first, x, xs, buf, kc, acc, as); break;
    case 3: qtile_f<R, 3>(first, x, xs, buf, kc, acc, as); break;
    default: qtile_f<R, 4>(first, x, xs, buf, kc, acc, as); break;
  }
}

// R rows (up to 6) x P panels; rows 5 and 6 only ever run with one panel (the many-rows path).
inline void run_tile(int64_t R, int P, const float* x, int64_t xs, const float* buf, int64_t kc, float* acc, int64_t as,
                     bool first) {
  switch (R) {
    case 1: qtile_p<1>(P, first, x, xs, buf, kc, acc, as); break;
    case 2: qtile_p<2>(P, first, x, xs, buf, kc, acc, as); break;
    case 3: qtile_p<3>(P, first, x, xs, buf, kc, acc, as); break;
    case 4: qtile_p<4>(P, first, x, xs, buf, kc, acc, as); break;
    case 5: qtile_f<5, 1>(first, x, xs, buf, kc, acc, as); break;
    default: qtile_f<6, 1>(first, x, xs, buf, kc, acc, as); break;
  }
}

// A thread's few-rows work is one stream of bytes: a group's P panels are adjacent and a task's groups consecutive.
// Each 32-k step (P * step_bytes of the stream) asks for the same amount kStreamAhead bytes further on, into L2
// (prefetcht1), so the stream stays that far ahead of the widening whatever the panel interleave; gemv_groups starts
// each task's stream. Measured on Zen 4 (2 threads, weights beyond the caches): Q4_1 blocks through the bf16 GEMV
// 11.8 -> 13.5 GB/s against per-panel prefetcht0 4 KB ahead; a plain read of the same groups 22.6 -> 31-37 GB/s.
constexpr int64_t kStreamAhead = 16384;

// bytes from p into L2 (prefetcht1), a cache line at a time.
inline void prefetch_l2(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

// The stream's bytes [pos, pos + bytes) of a group starting at `group`, kStreamAhead ahead.
inline void prefetch_stream(const uint8_t* group, int64_t pos, int64_t bytes) {
  prefetch_l2(group + pos + kStreamAhead, bytes);
}

// A few-rows kernel's share of its stream at 32-k step `step` (step_bytes per panel per step) of P panels: one stream
// where the panels are adjacent (a group), two where they are a [gate; up] pair (Paired: panel 0 a gate panel, panel 1
// its up panel pstride further on; each half's panels are adjacent, so each half is a stream of its own).
template <int P, bool Paired>
inline void prefetch_panels(const uint8_t* panel, int64_t pstride, int64_t step, int64_t step_bytes) {
  if constexpr (Paired) {
    static_assert(P == 2);
    prefetch_stream(panel, step * step_bytes, step_bytes);
    prefetch_stream(panel + pstride, step * step_bytes, step_bytes);
  } else {
    prefetch_stream(panel, step * P * step_bytes, P * step_bytes);
  }
}

#ifdef PAGEDSERVE_QUANT_AVX2
// The few-rows kernel: R rows of x against P panels (16 P columns) over all of K, the weights widened in
// registers one k at a time (no buffer): acc[r * 16 P + p * 16 + j] = the chain of row r, column p * 16 + j.
// init_panels: the 32-k step at k0 of P panels (and its share of the stream ahead).
// Paired: the P = 2 panels are a [gate; up] pair pstride apart (quant_linear_silu), two streams (prefetch_panels).
template <int64_t T, int P, bool Paired = false>
inline void init_panels(Widen<T, true>* wd, const uint8_t* panel, int64_t pstride, int64_t k0) {
  constexpr QuantType t = quant_type(T);
  constexpr int64_t pbb = 16 * t.block_bytes, step_bytes = 16 * t.block_bytes * 32 / t.block_size;
  const int64_t boff = (k0 / t.block_size) * pbb;
  const int s = static_cast<int>((k0 % t.block_size) / 32);
  PAGEDSERVE_UNROLL
  for (int p = 0; p < P; ++p) wd[p].init(panel + p * pstride + boff, s);
  prefetch_panels<P, Paired>(panel, pstride, k0 / 32, step_bytes);
}

template <int64_t T, int R, int P, bool Paired = false>
void gemv_panels(const float* x, int64_t xs, const uint8_t* panel, int64_t pstride, int64_t K, float* acc) {
  __m256 c0[R * P], c1[R * P];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) c0[i] = c1[i] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    Widen<T, true> wd[P];
    init_panels<T, P, Paired>(wd, panel, pstride, k0);
    auto step = [&]<bool HI>(int i) {
      const float* xk = x + k0 + (HI ? 16 + i : i);
      PAGEDSERVE_UNROLL
      for (int p = 0; p < P; ++p) {
        __m256 w0, w1;
        wd[p].template get<HI>(i, w0, w1);
        PAGEDSERVE_UNROLL
        for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_broadcast_ss(xk + r * xs);
          c0[r * P + p] = _mm256_fmadd_ps(a, w0, c0[r * P + p]);
          c1[r * P + p] = _mm256_fmadd_ps(a, w1, c1[r * P + p]);
        }
      }
    };
    for (int i = 0; i < 16; ++i) step.template operator()<false>(i);
    for (int i = 0; i < 16; ++i) step.template operator()<true>(i);
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) {
    _mm256_storeu_ps(acc + (i / P) * P * 16 + (i % P) * 16, c0[i]);
    _mm256_storeu_ps(acc + (i / P) * P * 16 + (i % P) * 16 + 8, c1[i]);
  }
}

template <int64_t T, int P, bool Paired = false>
inline void gemv_rows(int64_t R, const float* x, int64_t xs, const uint8_t* panel, int64_t pstride, int64_t K,
                      float* acc) {
  switch (R) {
    case 1: gemv_panels<T, 1, P, Paired>(x, xs, panel, pstride, K, acc); break;
    case 2: gemv_panels<T, 2, P, Paired>(x, xs, panel, pstride, K, acc); break;
    case 3: gemv_panels<T, 3, P, Paired>(x, xs, panel, pstride, K, acc); break;
    default: gemv_panels<T, 4, P, Paired>(x, xs, panel, pstride, K, acc); break;
  }
}

// The float32 route's fused SwiGLU epilogue (quant_linear_silu): rows x 16 gate sums at gate[r * as] and their up sums
// at up[r * as], silu_mul8 (silu_and_mul's float32 arithmetic) into y (row stride I).
inline void write_silu8(const float* gate, const float* up, int64_t as, int64_t rows, float* y, int64_t I) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < 16; j += 8)
      _mm256_storeu_ps(y + r * I + j,
                       silu_mul8(_mm256_loadu_ps(gate + r * as + j), _mm256_loadu_ps(up + r * as + j)));
  }
}
#endif

// A 64-byte aligned float scratch buffer (one per task).
struct Scratch {
  std::vector<float> v;
  float* p;
  explicit Scratch(int64_t n) : p(align64(v, n)) {}
};

template <typename OT>
inline void write_rows(const float* acc, int64_t as, int64_t rows, const float* bias, OT* y, int64_t N, int64_t n0,
                       int64_t nn) {
#ifdef PAGEDSERVE_AVX512
  if (nn == 16) {  // a whole panel: the same sums and roundings, 16 lanes at a time
    const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = _mm512_loadu_ps(acc + r * as);
      store16(y + r * N + n0, bias ? _mm512_add_ps(v, b) : v);
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    OT* out = y + r * N + n0;
    for (int64_t j = 0; j < nn; ++j) {
      const float v = bias ? acc[r * as + j] + bias[n0 + j] : acc[r * as + j];
      out[j] = Elem<OT>::store(v);
    }
  }
}

// np panels (16 columns each from p0) of rows x np * 16 sums (row stride as) into y, row by row: a row's columns
// are adjacent in y, so each of its cache lines is written whole at once (panel by panel, N * 2 or 4 bytes apart,
// the rows of a block fall on few cache sets and a line was evicted between its first and its second half).
template <typename OT>
inline void write_panels(const float* acc, int64_t as, int64_t rows, int np, int64_t p0, const float* bias, OT* y,
                         int64_t N) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < np; ++j) {
      const int64_t n0 = (p0 + j) * 16;
      write_rows(acc + r * as + j * 16, as, 1, bias, y + r * N, N, n0, std::min<int64_t>(16, N - n0));
    }
  }
}

#ifdef PAGEDSERVE_AVX512
// The fused SwiGLU epilogue: np panels (from p0) of gate sums at acc[r * as + 16 j] and of up sums `up` floats
// further, each rounded to bf16 as the matmul's bf16 output is, then silu_mul16 (silu_and_mul's arithmetic) into
// y (row stride I). Never inlined: inlined into the many-rows driver, its constants stayed in zmm registers across
// the row-tile loop, and GCC 12 compiled the 6 x 4 register tile there (24 accumulators, 4 weight vectors, 1
// broadcast) short of registers: weight vectors reloaded for every row and one accumulator stored and reloaded at
// every k pair. The fused SwiGLU ran ~12% slower than a plain matmul of the same shape (Zen 4, M = 2,048, N = 3,072,
// K = 576: 19.5 ms; 17.2 ms as a call, the same bits).
template <typename OT>
inline void silu_store16(const float* gate, int64_t up, OT* dst) {
  store16(dst, silu_mul16(round16(_mm512_loadu_ps(gate)), round16(_mm512_loadu_ps(gate + up))));
}

template <typename OT>
__attribute__((noinline)) void write_silu(const float* acc, int64_t as, int64_t rows, int np, int64_t p0, OT* y, int64_t I, int64_t up) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < np; ++j) silu_store16(acc + r * as + j * 16, up, y + r * I + (p0 + j) * 16);
  }
}
#endif

constexpr int64_t kGemvRows = 4;  // up to here: the few-rows path

// The few-rows driver: threads claim ranges of the groups of P (1 or 2) panels (claim_for: in a decode step's team
// too, so that neither member waits for the other's fixed share on a slower core); kernel(np, p0, acc) fills the
// M x 16 np sums of panels p0 .. p0 + np - 1 (row stride 16 np; M <= MaxRows), which are then written out with the
// bias. setup() runs once per range and what it returns lives until the range ends (the AMX route's tile
// configuration). w, pstride: the packed weights, so that a range starts its stream of panel bytes (the first
// kStreamAhead of it, into L2; the kernels keep it going).
template <int64_t MaxRows = kGemvRows, typename OT, typename F, typename S = decltype([] { return 0; })>
inline void gemv_groups(int64_t M, int P, int64_t panels, const uint8_t* w, int64_t pstride, const float* bias, OT* y,
                        int64_t N, F&& kernel, S setup = {}) {
  const int64_t groups = (panels + P - 1) / P;
  claim_for(groups, [&](int64_t g0, int64_t g1) {
    const int64_t task_bytes = (std::min(g1 * P, panels) - g0 * P) * pstride;
    prefetch_l2(w + g0 * P * pstride, std::min(kStreamAhead, task_bytes));
    [[maybe_unused]] const auto task = setup();
    alignas(64) float acc[MaxRows * 2 * 16];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * P;
      const int np = static_cast<int>(std::min<int64_t>(P, panels - p0));
      kernel(np, p0, acc);
      write_panels(acc, np * 16, M, np, p0, bias, y, N);
    }
  });
}

// The few-rows fused SwiGLU's driver (gemv_groups' for a [gate; up] weight, N = 2 I): threads claim the I / 16 pairs
// of gate panel p and its up panel, which lie `pairs` panels apart; kernel(p, acc) fills the (up to MaxRows) x 32 sums
// of pair p, then epilogue(p, acc) writes them as the many-rows route's epilogue does (silu_store16, write_silu8): the
// same bits as the matmul's output through silu_and_mul, with no [M, 2 I] product in between and each thread's
// epilogue on the sums it made.
template <int64_t MaxRows = kGemvRows, typename F, typename E, typename S = decltype([] { return 0; })>
inline void gemv_silu_pairs(int64_t pairs, const uint8_t* w, int64_t pstride, F&& kernel, E&& epilogue,
                            S setup = {}) {
  claim_for(pairs, [&](int64_t p0, int64_t p1) {
    const int64_t task_bytes = std::min(kStreamAhead / 2, (p1 - p0) * pstride);
    prefetch_l2(w + p0 * pstride, task_bytes);
    prefetch_l2(w + (pairs + p0) * pstride, task_bytes);
    [[maybe_unused]] const auto task = setup();
    alignas(64) float acc[MaxRows * 2 * 16];
    for (int64_t p = p0; p < p1; ++p) {
      kernel(p, acc);
      epilogue(p, acc);
    }
  });
}

// The many-rows float32 route's widened weights (quant_gemm): at most 16 MB, half of a 32 MB L3 (reading them from
// memory at every row block would cost more than widening them again); a grow-only buffer per calling thread (its
// parallel region's workers fill and read it during the call).
constexpr int64_t kWideFloats = int64_t{4} << 20;
inline float* wide_buffer(int64_t n) {
  thread_local std::vector<float> v;
  if (static_cast<int64_t>(v.size()) < n + 16) v.resize(n + 16);
  return align64_in(v);
}

// SILU (AVX2 builds, float32 out, no bias, N = 2 I with I % 16 == 0): y [M, I] = silu(gate) * up of the [gate; up]
// product, each output written from its gate and up sums as silu_and_mul computes it (quant_linear_silu).
template <int64_t T, typename OT, bool SILU = false>
void quant_gemm(const float* x, int64_t xs, const uint8_t* w, const float* bias, OT* y, int64_t M, int64_t N,
                int64_t K) {
  constexpr QuantType t = quant_type(T);
  const int64_t panels = (N + 15) / 16, pstride = 16 * (K / t.block_size) * t.block_bytes;
  if (M <= kGemvRows) {
#ifdef PAGEDSERVE_QUANT_AVX2
    if constexpr (SILU) {
      static_assert(std::is_same_v<OT, float>);
      // Gate panel g and its up panel: for 1-2 rows one paired call (4-8 chains), for 3-4 one call each (their sums
      // at acc and acc + 16 M).
      const int64_t pairs = panels / 2, up = pairs * pstride, I = N / 2;
      gemv_silu_pairs(
          pairs, w, pstride,
          [&](int64_t g, float* acc) {
            if (M <= 2) {
              gemv_rows<T, 2, true>(M, x, xs, w + g * pstride, up, K, acc);
            } else {
              gemv_rows<T, 1>(M, x, xs, w + g * pstride, pstride, K, acc);
              gemv_rows<T, 1>(M, x, xs, w + g * pstride + up, pstride, K, acc + M * 16);
            }
          },
          [&](int64_t g, const float* acc) {
            if (M <= 2) {
              write_silu8(acc, acc + 16, 32, M, y + g * 16, I);
            } else {
              write_silu8(acc, acc + M * 16, 16, M, y + g * 16, I);
            }
          });
      return;
    }
    // 1-2 rows x 2 panels, 3-4 rows x 1: 4-8 independent chains per k step, enough to hide the FMA
    // latency behind the widening.
    gemv_groups(M, M <= 2 ? 2 : 1, panels, w, pstride, bias, y, N, [&](int np, int64_t p0, float* acc) {
      if (np == 2) {
        gemv_rows<T, 2>(M, x, xs, w + p0 * pstride, pstride, K, acc);
      } else {
        gemv_rows<T, 1>(M, x, xs, w + p0 * pstride, pstride, K, acc);
      }
    });
#else
    // Portable: the many-rows scheme with slices of up to 4 panels (a slice of all of them is 16 KB).
    const int P = M == 1 ? 4 : (M <= 3 ? 2 : 1);
    const int64_t KC = 256 / P, groups = (panels + P - 1) / P;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      Scratch buf(P * KC * 16), acc(M * P * 16);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p0 = g * P;
        const int np = static_cast<int>(std::min<int64_t>(P, panels - p0));
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t kc = std::min(KC, K - k0);
          for (int j = 0; j < np; ++j) widen_range<T>(w + (p0 + j) * pstride, k0, kc, buf.p + j * kc * 16);
          run_tile(M, np, x + k0, xs, buf.p, kc, acc.p, np * 16, k0 == 0);
        }
        write_panels(acc.p, np * 16, M, np, p0, bias, y, N);
      }
    });
#endif
    return;
  }
  // Many rows: a block of MB rows of x (~256 KB, kept hot in L2 while the threads take its panels) against one panel
  // at a time, 256-k slices. Where 8 or more row blocks pass each panel and the widened weights fit kWideFloats (they
  // then stay in L3 for the row blocks after the first), the panels are first widened whole, once per call, into a
  // buffer of the calling thread; else each slice is widened into L1 once per row block. On a Zen 3 at 2,048 rows:
  // 1.00-1.06x (SmolLM2's gate_up 1.055x, down 1.038x); at 512 rows (5 row blocks) 0.97-1.02x, hence the 8.
  constexpr int64_t KC = 256;
  // Up to 264 rows (a decode step of up to 264 sequences) are one block whatever K, so that each panel is widened once:
  // x's rows then come from L3 rather than L2 (768 KB for W1's 128 rows at K = 1,536), which costs less than widening
  // again. On a Zen 3 (the same bits): 128 rows 1.03-1.05x at K = 576, 1.08x at K = 1,536, 1.03-1.06x at K = 2,048 and
  // 8,192; 256 rows 1.01x / 1.05x.
  int64_t MB = std::clamp<int64_t>((65536 / K) / 6 * 6, 48, 240);
  if (M <= 264) MB = (M + 5) / 6 * 6;
  float* wide = M >= 8 * MB && panels * 16 * K <= kWideFloats ? wide_buffer(panels * 16 * K) : nullptr;
  // Units of PU panels: a panel, or (SILU) gate panel u with its up panel u + I / 16, whose sums are written together
  // (acc: the unit's panel h at h * MB * 16). The items are (row block, unit) pairs, row block by row block, taken by
  // whichever thread is free (parallel_claims: on a host where one vCPU ran slower, 1.04-1.17x over a fixed share of
  // the units; the same at equal speeds); the widening first, a unit at a time, in a region of its own.
  constexpr int PU = SILU ? 2 : 1;
  const int64_t units = panels / PU, blocks = (M + MB - 1) / MB;
  if (wide)
    parallel_claims(units, [&](const auto& next) {
      for (int64_t u = next(); u >= 0; u = next())
        for (int h = 0; h < PU; ++h) {
          const int64_t p = u + h * units;
          widen_range<T>(w + p * pstride, 0, K, wide + p * K * 16);
        }
    });
  parallel_claims(blocks * units, [&](const auto& next) {
    Scratch buf(wide ? 0 : KC * 16), acc(PU * MB * 16);
    for (int64_t item = next(); item >= 0; item = next()) {
      const int64_t m0 = item / units * MB, u = item % units, mb = std::min(MB, M - m0);
      for (int h = 0; h < PU; ++h) {
        const int64_t p = u + h * units;
        float* a = acc.p + h * MB * 16;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t kc = std::min(KC, K - k0);
          const float* slice = buf.p;
          if (wide) {
            slice = wide + (p * K + k0) * 16;
          } else {
            widen_range<T>(w + p * pstride, k0, kc, buf.p);
          }
          for (int64_t r0 = 0; r0 < mb; r0 += 6)
            run_tile(std::min<int64_t>(6, mb - r0), 1, x + (m0 + r0) * xs + k0, xs, slice, kc, a + r0 * 16, 16,
                     k0 == 0);
        }
      }
      if constexpr (SILU) {
#ifdef PAGEDSERVE_QUANT_AVX2
        write_silu8(acc.p, acc.p + MB * 16, 16, mb, y + m0 * (N / 2) + u * 16, N / 2);
#endif
      } else {
        write_rows(acc.p, 16, mb, bias, y + m0 * N, N, u * 16, std::min<int64_t>(16, N - u * 16));
      }
    }
  });
}

// ---- the screened greedy head (float32 route, Q8_0 weights, AVX2): quant_linear_argmax -------------------------------
//
// Greedy decoding needs each row's argmax of its logits y = x @ W.T, not the logits themselves, and a column can be
// ruled out without its exact chain. A screen in integers, cheaper than the float32 FMA chains (vpmaddwd: 16
// multiply-adds per instruction against an FMA's 8; on a Zen 3 the pair below runs 1.5-1.6x the FMA rate), bounds
// every logit; only the few columns that can hold a row's maximum get their exact chain:
//   - x's row to int16 with one scale: qx = round(x * 32767 / max|x|), sx = max|x| / 32767;
//   - per 32-k block b, the integer dot I_b = sum qx_k q_k against the block's Q8_0 quants (exact in int32: |I_b| <=
//     32 * 32767 * 128 < 2^31), then s = sx * sum_b d_b I_b in float32;
//   - |s - y| <= B = coef(row) * norm(column), norm = sum_k |w_k| (quant_screen_norms: rounded up, once per weight),
//     coef = 1.02 (0.51 sx + 1.01 (K + nb + 5) 2^-24 max|x|): half a step of x's rounding (plus the scale's two
//     roundings, < 0.01 sx), y's own float32 chain (K roundings, each within 2^-24 of a partial sum bounded by
//     max|x| norm), s's conversions, nb FMAs and product; the 1.02 covers B's own roundings and the comparisons;
//   - a column whose s + B is below some column's s - B cannot hold the row's maximum (its y is below that column's).
//     The others, the candidates (SmolLM2's W1 rows: 1 per row at the median, at most 2 in 49 checked), get their
//     panel's exact chains (gemv_panels: the bits of quant_gemm at every M), and the first largest of those is the
//     row's argmax: the index argmax_rows finds in quant_linear's logits.
// A row with a non-finite x, max|x| outside [2^-60, 2^64) or more than N / 8 candidates gets every exact logit instead
// (a NaN among them gives -1, as RowArgmax's rows do).
#ifdef PAGEDSERVE_QUANT_AVX2
constexpr int64_t kScreenTile = 6;               // rows per screen tile (12 int32 accumulators)
constexpr int64_t kQ8Block = 16 * quant_type(kQ8_0).block_bytes;  // a packed Q8_0 block of 16 rows: 16 halves d,
                                                                  // then 32 planes of 16 quants
constexpr uint32_t kScreenMaxBits = 0x5f800000;  // 2^64
constexpr uint32_t kScreenMinBits = 0x21800000;  // 2^-60

// The screens' norms: |d| sum_k |q| of column r (of 16) of a packed Q8_0 block, in double (exact: an fp16 d times an
// integer below 2^12); false where d is an fp16 infinity or NaN (read from its bits: -ffast-math).
inline bool q8_block_l1(const uint8_t* pb, int64_t r, double& l1) {
  uint16_t h;
  std::memcpy(&h, pb + 2 * r, 2);
  int64_t qsum = 0;
  for (int64_t k = 0; k < 32; ++k) qsum += std::abs(static_cast<int>(static_cast<int8_t>(pb[32 + 16 * k + r])));
  l1 = std::fabs(static_cast<double>(half_to_float(pb + 2 * r))) * static_cast<double>(qsum);
  return ((h >> 10) & 0x1Fu) != 0x1Fu;
}

// The float nearest v from above (a norm never below the exact one).
inline float float_up(double v) {
  float f = static_cast<float>(v);
  if (static_cast<double>(f) < v) f = std::nextafter(f, std::numeric_limits<float>::max());
  return f;
}

// One Q8_0 panel's quants as int16 pairs for vpmaddwd: wb[(b * 16 + j) * 32 + 2 r + h] = q of row r at k = 32 b + 2 j + h
// (rows 0-7, then 8-15: one vector each), the two quant planes of a k pair interleaved and sign-extended.
inline void widen_q8_pairs(const uint8_t* panel, int64_t nb, int16_t* wb) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + b * kQ8Block;
    for (int j = 0; j < 16; ++j) {
      const __m128i lo = ld(pb + 32 + 32 * j), hi = ld(pb + 48 + 32 * j);
      int16_t* o = wb + (b * 16 + j) * 32;
      _mm256_store_si256(reinterpret_cast<__m256i*>(o), _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(o + 16), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(lo, hi)));
    }
  }
}

// One k pair of one row: c0 / c1 (columns 0-7 / 8-15) += x's pair at xp times the widened quants w0 / w1 (in
// registers: 12 accumulators, 2 weights, the broadcast and a product are AVX2's 16 vector registers). In asm so that
// each row's broadcast lives only through its two products: GCC 12 hoisted the 6 rows' broadcasts above them, and
// 6 + 2 + 12 live vectors left it storing and reloading most accumulators at every k pair (the screen then ran no
// faster than the float32 FMA chains). The weights as memory operands instead (a load per vpmaddwd, 18 loads per 192
// products) ran ~0.85x as fast on a Zen 3 (a /tmp loop of the 6-row step: 19.1-19.8 against 22.5-22.9 products per
// cycle).
#define PAGEDSERVE_SCREEN_STEP(c0, c1, xp)                                                                     \
  asm("vpbroadcastd %[x], %[a]\n\t"                                                                            \
      "vpmaddwd %[w0], %[a], %[t]\n\t"                                                                         \
      "vpaddd %[t], %[s0], %[s0]\n\t"                                                                          \
      "vpmaddwd %[w1], %[a], %[a]\n\t"                                                                         \
      "vpaddd %[a], %[s1], %[s1]"                                                                              \
      : [s0] "+x"(c0), [s1] "+x"(c1), [a] "=&x"(a), [t] "=&x"(t)                                               \
      : [x] "m"(*reinterpret_cast<const int32_t*>(xp)), [w0] "x"(w0), [w1] "x"(w1))

// s[r * 16 + j] = sum_b d_b[j] I_b[r][j] for R rows of int16 x (row stride xs, from block 0) against one Q8_0 panel
// (its scales at `panel`, its quants widened by widen_q8_pairs into wb): per k pair and row, x's pair broadcast and one
// vpmaddwd per 8 columns.
template <int R>
inline void screen_tile(const int16_t* qx, int64_t xs, const int16_t* wb, const uint8_t* panel, int64_t nb, float* s) {
  static_assert(R >= 1 && R <= 6);
  for (int64_t i = 0; i < R * 16; ++i) s[i] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int16_t* xb = qx + b * 32;
    // Named accumulators (an array of them stayed in memory, loaded and stored around every step).
    __m256i p0 = _mm256_setzero_si256(), q0 = p0, p1 = p0, q1 = p0, p2 = p0, q2 = p0, p3 = p0, q3 = p0, p4 = p0,
            q4 = p0, p5 = p0, q5 = p0;
#pragma GCC unroll 2
    for (int j = 0; j < 16; ++j) {
      const __m256i* w = reinterpret_cast<const __m256i*>(wb + (b * 16 + j) * 32);
      const __m256i w0 = _mm256_load_si256(w), w1 = _mm256_load_si256(w + 1);
      const int16_t* xp = xb + 2 * j;
      __m256i a, t;
      PAGEDSERVE_SCREEN_STEP(p0, q0, xp);
      if constexpr (R > 1) PAGEDSERVE_SCREEN_STEP(p1, q1, xp + xs);
      if constexpr (R > 2) PAGEDSERVE_SCREEN_STEP(p2, q2, xp + 2 * xs);
      if constexpr (R > 3) PAGEDSERVE_SCREEN_STEP(p3, q3, xp + 3 * xs);
      if constexpr (R > 4) PAGEDSERVE_SCREEN_STEP(p4, q4, xp + 4 * xs);
      if constexpr (R > 5) PAGEDSERVE_SCREEN_STEP(p5, q5, xp + 5 * xs);
    }
    __m256 d0, d1;
    halves(panel + b * kQ8Block, d0, d1);
    const __m256i ps[6] = {p0, p1, p2, p3, p4, p5}, qs[6] = {q0, q1, q2, q3, q4, q5};
    PAGEDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(s + r * 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ps[r]), d0, _mm256_loadu_ps(s + r * 16)));
      _mm256_storeu_ps(s + r * 16 + 8,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(qs[r]), d1, _mm256_loadu_ps(s + r * 16 + 8)));
    }
    // The float sums stay in memory (kept in registers across the blocks, they would take the accumulators' place).
    asm volatile("" : : "r"(s) : "memory");
  }
}
#undef PAGEDSERVE_SCREEN_STEP

inline void screen_rows(int64_t R, const int16_t* qx, int64_t xs, const int16_t* wb, const uint8_t* panel, int64_t nb,
                        float* s) {
  switch (R) {
    case 1: screen_tile<1>(qx, xs, wb, panel, nb, s); break;
    case 2: screen_tile<2>(qx, xs, wb, panel, nb, s); break;
    case 3: screen_tile<3>(qx, xs, wb, panel, nb, s); break;
    case 4: screen_tile<4>(qx, xs, wb, panel, nb, s); break;
    case 5: screen_tile<5>(qx, xs, wb, panel, nb, s); break;
    default: screen_tile<6>(qx, xs, wb, panel, nb, s); break;
  }
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// int64 [M]: each row's first argmax of quant_gemm's float32 logits over a Q8_0 weight (no bias), -1 where one is NaN
// (only a row that takes every exact logit can have one). norms: quant_screen_norms' [panels * 16].
void screened_argmax(const float* x, int64_t xs, const uint8_t* w, const float* norms, int64_t M, int64_t N,
                     int64_t K, int64_t* out) {
  const int64_t nb = K / 32, panels = (N + 15) / 16, pstride = nb * kQ8Block, qs = K + 16;
  std::vector<int16_t> qbuf(M * qs);
  std::vector<float> sx(M, 0.f), coef(M, 0.f);
  std::vector<uint8_t> full(M, 0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * xs;
      uint32_t top = 0;  // max |x| as bits (a NaN or infinity above every finite value)
      for (int64_t k = 0; k < K; ++k) {
        uint32_t bits;
        std::memcpy(&bits, xr + k, 4);
        top = std::max(top, bits & 0x7fffffffu);
      }
      int16_t* q = qbuf.data() + m * qs;
      if (top < kScreenMinBits || top >= kScreenMaxBits) {
        full[m] = 1;
        std::fill(q, q + K, int16_t{0});
        continue;
      }
      float xmax;
      std::memcpy(&xmax, &top, 4);
      const float inv = 32767.f / xmax;
      for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int16_t>(std::lrint(xr[k] * inv));  // |.| <= 32767
      sx[m] = xmax / 32767.f;
      coef[m] = 1.02f * (0.51f * sx[m] + 1.01f * static_cast<float>(K + nb + 5) * 0x1p-24f * xmax);
    }
  });
  // The screen: threads claim ranges of the panels (claim_for: a slower core takes fewer); each keeps per row the
  // largest s - B so far (lower) and the columns whose s + B reached it when they were screened (a superset of those
  // reaching the final lower, which only grows). Which thread screens a panel changes neither: the argmax is exact.
  const int64_t threads = at::get_num_threads(), cap = std::max<int64_t>(64, N / 8);
  std::vector<float> lower(threads * M, -std::numeric_limits<float>::infinity());
  std::vector<std::vector<std::pair<int32_t, float>>> cand(threads * M);
  std::vector<uint8_t> over(threads * M, 0);
  claim_for(panels, [&](int64_t p0, int64_t p1) {
    const int64_t t = at::get_thread_num();
    alignas(32) float s[kScreenTile * 16], up[16];
    std::vector<int16_t> wbuf;
    int16_t* wb = align64(wbuf, nb * 512);
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    const __m256 iota0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), iota1 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * 16;
      const __m256 live = _mm256_set1_ps(static_cast<float>(std::min<int64_t>(16, N - n0)));
      const __m256 ok0 = _mm256_cmp_ps(iota0, live, _CMP_LT_OQ), ok1 = _mm256_cmp_ps(iota1, live, _CMP_LT_OQ);
      const __m256 nv0 = _mm256_loadu_ps(norms + n0), nv1 = _mm256_loadu_ps(norms + n0 + 8);
      widen_q8_pairs(w + p * pstride, nb, wb);
      for (int64_t r0 = 0; r0 < M; r0 += kScreenTile) {
        const int64_t R = std::min(kScreenTile, M - r0);
        screen_rows(R, qbuf.data() + r0 * qs, qs, wb, w + p * pstride, nb, s);
        for (int64_t i = 0; i < R; ++i) {
          const int64_t m = r0 + i, at = t * M + m;
          if (full[m] || over[at]) continue;
          const __m256 sv = _mm256_set1_ps(sx[m]), cv = _mm256_set1_ps(coef[m]);
          const __m256 v0 = _mm256_mul_ps(_mm256_loadu_ps(s + i * 16), sv);
          const __m256 v1 = _mm256_mul_ps(_mm256_loadu_ps(s + i * 16 + 8), sv);
          const __m256 b0 = _mm256_mul_ps(nv0, cv), b1 = _mm256_mul_ps(nv1, cv);
          const __m256 u0 = _mm256_blendv_ps(ninf, _mm256_add_ps(v0, b0), ok0);
          const __m256 u1 = _mm256_blendv_ps(ninf, _mm256_add_ps(v1, b1), ok1);
          const __m256 l0 = _mm256_blendv_ps(ninf, _mm256_sub_ps(v0, b0), ok0);
          const __m256 l1 = _mm256_blendv_ps(ninf, _mm256_sub_ps(v1, b1), ok1);
          lower[at] = std::max(lower[at], hmax8(_mm256_max_ps(l0, l1)));
          const __m256 lv = _mm256_set1_ps(lower[at]);
          uint32_t bits = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(u0, lv, _CMP_GE_OQ))) |
                          static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(u1, lv, _CMP_GE_OQ))) << 8;
          if (!bits) continue;
          _mm256_store_ps(up, u0);
          _mm256_store_ps(up + 8, u1);
          auto& c = cand[at];
          for (; bits; bits &= bits - 1) {
            const int j = __builtin_ctz(bits);
            c.emplace_back(static_cast<int32_t>(n0 + j), up[j]);
          }
          if (static_cast<int64_t>(c.size()) > cap) over[at] = 1;
        }
      }
    }
  });
  // Per row: the candidates' panels (or all), their exact chains, the first largest.
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    alignas(32) float acc[16];
    std::vector<int64_t> pan;
    for (int64_t m = m0; m < m1; ++m) {
      bool all = full[m];
      float lo = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < threads; ++t) {
        all = all || over[t * M + m];
        lo = std::max(lo, lower[t * M + m]);
      }
      pan.clear();
      if (all) {
        for (int64_t p = 0; p < panels; ++p) pan.push_back(p);
      } else {
        for (int64_t t = 0; t < threads; ++t)
          for (const auto& [c, u] : cand[t * M + m])
            if (u >= lo) pan.push_back(c / 16);
        std::sort(pan.begin(), pan.end());
        pan.erase(std::unique(pan.begin(), pan.end()), pan.end());
      }
      float best = -std::numeric_limits<float>::infinity();
      int64_t col = 0;
      bool nan = false;
      for (const int64_t p : pan) {
        gemv_panels<kQ8_0, 1, 1>(x + m * xs, xs, w + p * pstride, pstride, K, acc);
        for (int64_t j = 0; j < std::min<int64_t>(16, N - p * 16); ++j) {
          nan = nan || nan_bits(acc[j]);
          if (acc[j] > best) {
            best = acc[j];
            col = p * 16 + j;
          }
        }
      }
      out[m] = nan ? -1 : col;
    }
  });
}
#endif

// set_amx's switch (amx_active below says whether the AMX routes run).
std::atomic<bool> g_amx_on{true};

// ---- bf16 weights (AVX512-BF16): quant_linear_bf16 -------------------------------------------------------
//
// A bf16 model computes with bf16 weights, as transformers does when it loads a GGUF in bfloat16: each weight
// is gguf-py's float32 value rounded to nearest-even bf16. Those weights (widened from the blocks, rounded in
// registers) and bf16 activations go to AVX512-BF16 pair dot products (vdpbf16ps), float32 sums. Each output
// is ONE chain of vdpbf16ps steps over the k pairs (0,1), (2,3), ... in order, started at 0, whatever M, the
// row's place in a tile, the tile's panels or the thread count: batch-invariant as quant_linear is.
//
// Per work item (a group of up to 4 panels = 64 output columns, and a block of x rows) the group's weights
// are widened once into a bf16 buffer [panel][k / 2][16 rows][2] (a 512-bit load is one k pair of 16 rows),
// then 6-row x 4-panel register tiles (24 accumulators) run over all of K.
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(PAGEDSERVE_QUANT_AVX2)
#define PAGEDSERVE_QUANT_BF16 1
#if defined(__AVX512VBMI__)
#define PAGEDSERVE_QUANT_LANES 1  // the lane-local Q4_0 / Q4_1 packing (FastPairs::lanes4)
#endif
constexpr int64_t kBfPanels = 4;  // panels per group
constexpr int64_t kBfRows = 6;    // rows per register tile

// The bf16 weights of the 32-k sub-block at k0 of one panel into out[(k - k0) / 2 * 32 + 2 r + k % 2] (16 pair
// vectors, 1 KB: one AMX B tile).
template <int64_t T>
__attribute__((always_inline)) inline void widen_sub_bf16(const uint8_t* panel, int64_t k0, uint16_t* out);

// The bf16 weights of one panel, all of K, into out[(k / 2) * 32 + 2 r + k % 2].
template <int64_t T>
void widen_panel_bf16(const uint8_t* panel, int64_t K, uint16_t* out) {
  for (int64_t k0 = 0; k0 < K; k0 += 32) widen_sub_bf16<T>(panel, k0, out + k0 * 16);
}

// acc[r][p] = chain over the k pairs of x[r] (bf16, row stride xs) . buf panel p; R rows, P panels.
template <int R, int P>
inline void bf16_tile(const uint16_t* x, int64_t xs, const uint16_t* buf, int64_t K, float* acc, int64_t as) {
  __m512 c[R * P];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) c[i] = _mm512_setzero_ps();
  const int64_t pstride = K * 16;  // uint16 per panel in buf
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512bh w[P];
    PAGEDSERVE_UNROLL
    for (int p = 0; p < P; ++p) w[p] = (__m512bh)_mm512_loadu_si512(buf + p * pstride + kp * 32);
    PAGEDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * xs + 2 * kp, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      PAGEDSERVE_UNROLL
      for (int p = 0; p < P; ++p) c[r * P + p] = _mm512_dpbf16_ps(c[r * P + p], a, w[p]);
    }
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) _mm512_storeu_ps(acc + (i / P) * as + (i % P) * 16, c[i]);
}

template <int P>
inline void bf16_tile_rows(int64_t R, const uint16_t* x, int64_t xs, const uint16_t* buf, int64_t K, float* acc,
                           int64_t as) {
  switch (R) {
    case 1: bf16_tile<1, P>(x, xs, buf, K, acc, as); break;
    case 2: bf16_tile<2, P>(x, xs, buf, K, acc, as); break;
    case 3: bf16_tile<3, P>(x, xs, buf, K, acc, as); break;
    case 4: bf16_tile<4, P>(x, xs, buf, K, acc, as); break;
    case 5: bf16_tile<5, P>(x, xs, buf, K, acc, as); break;
    default: bf16_tile<6, P>(x, xs, buf, K, acc, as); break;
  }
}

inline void bf16_tile_any(int64_t R, int P, const uint16_t* x, int64_t xs, const uint16_t* buf, int64_t K, float* acc,
                          int64_t as) {
  switch (P) {
    case 1: bf16_tile_rows<1>(R, x, xs, buf, K, acc, as); break;
    case 2: bf16_tile_rows<2>(R, x, xs, buf, K, acc, as); break;
    case 3: bf16_tile_rows<3>(R, x, xs, buf, K, acc, as); break;
    default: bf16_tile_rows<4>(R, x, xs, buf, K, acc, as); break;
  }
}

// Every type read in place (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): the 16 k pairs of a 32-k sub-block of a
// packed block widened straight into bf16 pair vectors with 512-bit ops (two byte planes side by side -> interleaved
// -> float32 -> scale -> bf16), the values of the float32 route's Widen rounded to bf16: the scale times q is exact
// in float32 (an fp16 d, times a 6-bit K-quant scale, times at most 6 bits of q), so d * q (+ m, - dmin * min) rounds
// once either way (an fma rounds the exact product plus m once, as Widen's mul then add does), then nearest-even.
template <int64_t T>
struct FastPairs {
  static constexpr int64_t B = base_type(T);  // the block format (T: kQ4_0L / kQ4_1L packed lane-local)
  static constexpr bool kLanes = T != B;
  static constexpr bool kOk = B == kQ4_0 || B == kQ4_1 || B == kQ8_0 || B == kQ5_0 || B == kQ5_1 || B == kQ4_K ||
                              B == kQ5_K || B == kQ6_K;
  static constexpr bool kKScales = B == kQ4_K || B == kQ5_K;  // d * 6-bit scale, dmin * 6-bit min per sub-block
  const uint8_t* q;
  const uint8_t* h;       // Q5_0, Q5_1, Q5_K, Q6_K: the high-bit planes
  __m512 d0, d1, m0, m1;  // (scale_r, scale_r) for rows 0-7 and 8-15, and the mins (Q6_K: the second scale)
  __m128i sh, hs;         // Q4_K, Q5_K, Q6_K: the nibble shift; Q5_K, Q6_K: the high bits' shift
  bool magic = false;     // init found make's magic form exact for this sub-block (see there): get2<true>

  // A 16-lane row vector -> (v_r, v_r) pairs for rows 0-7 and 8-15 (scales: times make's kUnit, exact).
  static inline void pairs(__m512 v, __m512& lo, __m512& hi) {
    const __m512i l = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    lo = _mm512_permutexvar_ps(l, v);
    hi = _mm512_permutexvar_ps(_mm512_add_epi32(l, _mm512_set1_epi32(8)), v);
  }
  static inline __m512 halves16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  // The 32-k sub-block at k0 of a panel.
  inline void init(const uint8_t* panel, int64_t k0) {
    constexpr QuantType t = quant_type(T);
    const uint8_t* pb = panel + (k0 / t.block_size) * 16 * t.block_bytes;
    const int s = static_cast<int>((k0 % t.block_size) / 32);
    const __m512 d = halves16(pb);
    if constexpr (kKScales) {  // d * scale and dmin * min of sub-block s
      __m128i sc, mn;
      k_scale_min16(pb + 64, s, sc, mn);
      scales(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc))),
             _mm512_mul_ps(halves16(pb + 32), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn))));
      q = pb + (B == kQ4_K ? 256 : 768) + (s / 2) * 32 * 16;
      sh = _mm_cvtsi32_si128(4 * (s & 1));
      if constexpr (B == kQ5_K) {  // qh plane l holds the fifth bit of k = 32 s + l at bit s
        h = pb + 256;
        hs = _mm_cvtsi32_si128(s);
      }
      return;
    } else if constexpr (B == kQ6_K) {  // k = 32 s + i has scale 2 s (i < 16) or 2 s + 1
      const __m512 du = _mm512_mul_ps(d, _mm512_set1_ps(kSlowUnit));
      pairs(_mm512_mul_ps(du, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ld(pb + 32 + (2 * s) * 16)))), d0, d1);
      pairs(_mm512_mul_ps(du, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ld(pb + 32 + (2 * s + 1) * 16)))), m0, m1);
      q = pb + 288 + ((s / 4) * 64 + (s % 2) * 32) * 16;
      sh = _mm_cvtsi32_si128(4 * ((s / 2) % 2));
      h = pb + 2336 + (s / 4) * 32 * 16;
      hs = _mm_cvtsi32_si128(2 * (s % 4));
      return;
    }
    scales(d, B == kQ4_1 || B == kQ5_1 ? halves16(pb + 32) : _mm512_setzero_ps());
    if constexpr (B == kQ4_1) {
      q = pb + 64;
    } else if constexpr (B == kQ5_1) {
      h = pb + 64;
      q = pb + 128;
    } else if constexpr (B == kQ5_0) {
      h = pb + 32;
      q = pb + 96;
    } else {
      q = pb + 32;
    }
  }

  // 32 bytes [byte plane a (16 rows) | plane a + 1] -> pair vector of the two k's they hold (second: Q6_K's pairs
  // of k >= 16, which take the second scale).
#if defined(__AVX512VBMI__)
  // With VBMI one vpermb per 16 lanes moves byte (row r, k) and (r, k + 1) into lanes 2 r, 2 r + 1, in one of two
  // forms that give the same bits:
  //  - slow: into the top byte, the other bytes zeroed: the int32 lane is q * 2^24 whatever q's sign, converted
  //    exactly, and the scales carry the 2^-24 (kSlowUnit), so each product is d * q exactly.
  //  - magic (kMagic: every type but Q6_K): the unsigned quant q (Q4_0 / Q5_0 before their offsets, Q8_0 with its
  //    sign bit flipped: q + 128) into byte 2 of a lane that otherwise holds 2.0f (Q8_0's 8 bits: byte 1 of 1.0f),
  //    so the lane already is the float F = 2 + q / 64 (1 + q / 2^15): no conversion (two fewer ops of ~13 per pair
  //    vector). With D' = 64 D (2^15 D), D' F = 128 D + D q (2^15 D + D q), so fma(F, D', c) with c = m - 128 D
  //    (Q4_1, Q5_1), -dmin * min - 128 D (K-quants), -(128 + 8) D, -(128 + 16) D (Q4_0, Q5_0) or -(2^15 + 128) D
  //    (Q8_0) rounds the exact D q + m (D (q - 8), ...) once, as the slow form does -- where c itself is exact, which
  //    scales() checks for the 16 rows of each sub-block (else the slow form): always so for finite D on the signed
  //    types, and for Q4_1 unless m and 128 D are about 2^12 apart. (A zero weight may come out +0 where the slow
  //    form gives -0: every sum starts at +0, so no output can tell.)
  static constexpr bool kMagic = B != kQ6_K;
  static constexpr float kSlowUnit = 1.f / 16777216.f;
  static constexpr float kUnit = B == kQ8_0 ? 32768.f : 64.f;
  static constexpr int32_t kBase = B == kQ8_0 ? 0x3F800000 : 0x40000000;  // 1.0f, 2.0f
  static constexpr __mmask64 kMagicByte = B == kQ8_0 ? 0x2222222222222222ull : 0x4444444444444444ull;
  static constexpr float kOffset = B == kQ4_0 ? 8.f : B == kQ5_0 ? 16.f : B == kQ8_0 ? 128.f : 0.f;

  // Lane l: byte 32 half + (l % 2) * 16 + row0 + l / 2 of the 64, in every byte.
  static inline __m512i byte_idx(int row0, int half) {
    const auto b = [=](int l) { return static_cast<int>((32 * half + (l % 2) * 16 + row0 + l / 2) * 0x01010101u); };
    return _mm512_set_epi32(b(15), b(14), b(13), b(12), b(11), b(10), b(9), b(8), b(7), b(6), b(5), b(4), b(3), b(2),
                            b(1), b(0));
  }

  // d0, d1 and m0, m1 from the rows' scales D (d, or d * scale) and mins m (Q4_1, Q5_1: + m; K-quants: dmin * min,
  // subtracted). The magic form's c = a + b, a = m (-dmin * min; signed types: -128 D or -2^15 D), b = -128 D
  // (-offset D), is taken where c - a == b and c - b == a in every row: c is the exact a + b exactly where both hold
  // (Fast2Sum: with |x| >= |y| of the two, c - x is computed exactly, so it equals the other only where c does;
  // a NaN or an infinity fails it). Two subtractions instead of TwoSum's five (Zen 4: 1.6% of a Q4_1 GEMV).
  inline void scales(__m512 D, __m512 m) {
    if constexpr (kMagic) {
      constexpr int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // explicit rounding: opaque to fast-math
      const __m512 sD = _mm512_mul_ps(D, _mm512_set1_ps(-kUnit));  // exact (D has at most 17 significant bits)
      __m512 a, b;
      if constexpr (kOffset != 0.f) {
        a = B == kQ8_0 ? sD : _mm512_add_round_ps(sD, sD, rn);
        b = _mm512_mul_ps(D, _mm512_set1_ps(-kOffset));
      } else {
        a = kKScales ? _mm512_sub_round_ps(_mm512_setzero_ps(), m, rn) : m;
        b = _mm512_add_round_ps(sD, sD, rn);
      }
      const __m512 c = _mm512_add_round_ps(a, b, rn);
      magic = (_mm512_cmp_ps_mask(_mm512_sub_round_ps(c, a, rn), b, _CMP_EQ_OQ) &
               _mm512_cmp_ps_mask(_mm512_sub_round_ps(c, b, rn), a, _CMP_EQ_OQ)) == 0xFFFF;
      if (magic) {
        pairs(_mm512_mul_ps(D, _mm512_set1_ps(kUnit)), d0, d1);
        pairs(c, m0, m1);
        return;
      }
    }
    pairs(_mm512_mul_ps(D, _mm512_set1_ps(kSlowUnit)), d0, d1);
    pairs(m, m0, m1);
  }

  // Back to the slow form's scales (a caller that widens several panels in one form): D' 2^-30 (Q8_0: 2^-39) is D
  // 2^-24, and m = c + 128 D (K-quants: dmin * min = -(c + 128 D)), all exact as c is.
  inline void to_slow() {
    if constexpr (kMagic) {
      if (!magic) return;
      magic = false;
      const __m512 u = _mm512_set1_ps(kSlowUnit / kUnit), b = _mm512_set1_ps(128.f / kUnit);
      m0 = _mm512_fmadd_ps(d0, b, m0);
      m1 = _mm512_fmadd_ps(d1, b, m1);
      if constexpr (kKScales) {
        m0 = _mm512_sub_ps(_mm512_setzero_ps(), m0);
        m1 = _mm512_sub_ps(_mm512_setzero_ps(), m1);
      }
      d0 = _mm512_mul_ps(d0, u);
      d1 = _mm512_mul_ps(d1, u);
    }
  }

  // The pair vector of make's magic-form floats F0 (rows 0-7) and F1 (rows 8-15), each lane a quant under kBase:
  // fma(F, D', c), rounded to bf16.
  inline __m512i magic_pair(__m512i F0, __m512i F1) const {
    const __m512 f0 = _mm512_fmadd_ps(_mm512_castsi512_ps(F0), d0, m0);
    const __m512 f1 = _mm512_fmadd_ps(_mm512_castsi512_ps(F1), d1, m1);
    return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
  }

  // 64 bytes, [byte plane a (16 rows) | plane a + 1] twice -> pair vector of the two k's of the half's planes.
  template <bool Magic>
  inline __m512i make(__m512i v, int half, bool second) const {
    __m512 f0, f1;
    if constexpr (Magic && kMagic) {
      const __m512i base = _mm512_set1_epi32(kBase);
      return magic_pair(_mm512_mask_permutexvar_epi8(base, kMagicByte, byte_idx(0, half), v),
                        _mm512_mask_permutexvar_epi8(base, kMagicByte, byte_idx(8, half), v));
    }
    constexpr __mmask64 top = 0x8888888888888888ull;
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(top, byte_idx(0, half), v));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(top, byte_idx(8, half), v));
    if constexpr (kKScales) {  // d * scale * q - dmin * min
      f0 = _mm512_fmsub_ps(q0, d0, m0);
      f1 = _mm512_fmsub_ps(q1, d1, m1);
    } else if constexpr (B == kQ4_1 || B == kQ5_1) {  // d * q + m
      f0 = _mm512_fmadd_ps(q0, d0, m0);
      f1 = _mm512_fmadd_ps(q1, d1, m1);
    } else {  // signed: q, q - 8, q - 16, q - 32 (get took the offsets)
      f0 = _mm512_mul_ps(q0, B == kQ6_K && second ? m0 : d0);
      f1 = _mm512_mul_ps(q1, B == kQ6_K && second ? m1 : d1);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
  }

  // Q4_0 / Q4_1 in the magic form (kNibbles): pair vectors j and j + 1 (j even; their k's are the low nibbles of
  // byte planes 2 j .. 2 j + 3) into lo0, lo1, and pair vectors j + 8 and j + 9 (the high nibbles of the same planes:
  // k + 16) into hi0, hi1 -- get2<true>'s bits for all four. Per row half one unmasked vpermb moves the raw byte of
  // each lane's (row, k) into all four bytes of the lane; a vpternlogd keeps its low nibble (bits 16-19) under make's
  // 2.0f, and after a 4-bit right shift its high nibble: one lane-crossing op per two pair vectors instead of two per
  // pair vector (Zen 4, benchmarks/avx512/widen_costs.cpp: 6.1 -> 5.9 cycles per pair vector at 1 row, 3.7 -> 3.3 per
  // pair vector and row at 2).
  static constexpr bool kNibbles = B == kQ4_0 || B == kQ4_1;
  inline void get4(int j, __m512i& lo0, __m512i& lo1, __m512i& hi0, __m512i& hi1) const {
    static_assert(kNibbles);
    const __m512i raw = load64(q + 2 * j * 16);
    const auto half = [&](int hf, __m512i& lo, __m512i& hi) __attribute__((always_inline)) {
      const __m512i v0 = _mm512_permutexvar_epi8(byte_idx(0, hf), raw);
      const __m512i v1 = _mm512_permutexvar_epi8(byte_idx(8, hf), raw);
      lo = nibbles(v0, v1);
      hi = nibbles(_mm512_srli_epi32(v0, 4), _mm512_srli_epi32(v1, 4));
    };
    half(0, lo0, hi0);
    half(1, lo1, hi1);
  }
  // The pair vector of rows 0-7 (v0) and 8-15 (v1) from the nibbles at bits 16-19 of their lanes (magic form).
  inline __m512i nibbles(__m512i v0, __m512i v1) const {
    const __m512i at16 = _mm512_set1_epi32(0x000F0000), base = _mm512_set1_epi32(kBase);
    return magic_pair(_mm512_ternarylogic_epi32(v0, at16, base, 0xEA),  // 0xEA: (v & at16) | base
                      _mm512_ternarylogic_epi32(v1, at16, base, 0xEA));
  }

  // get4 (magic form), or lanes4 in either form where kLanes: what the callers run for Q4_0 / Q4_1 where quads<Magic>.
  template <bool Magic>
  static constexpr bool quads = kNibbles && (Magic || kLanes);
  template <bool Magic>
  __attribute__((always_inline)) inline void get4x(int j, __m512i& lo0, __m512i& lo1, __m512i& hi0,
                                                   __m512i& hi1) const {
    if constexpr (kLanes) {
      lanes4<Magic>(j, lo0, lo1, hi0, hi1);
    } else {
      static_assert(Magic);
      get4(j, lo0, lo1, hi0, hi1);
    }
  }
  // get4's four pair vectors (and in the converting form, Magic false, get2<false>'s bits) from the lane-local
  // packing (kLanes: packed_index). Pair vector j's quants (k = 2 j, 2 j + 1: the low nibbles of planes 2 j, 2 j + 1)
  // lie in group j / 4 (rows 0-7) and the next (rows 8-15) at bits 8 (j % 4) .. + 3 of each lane, pair vector j + 8's
  // (their high nibbles, k + 16) four bits above: a shift puts them where make wants them, with no lane crossing
  // (Zen 4, benchmarks/lanes_ab.py: W2's layer GEMVs 0.925x the time of get4's vpermb form hot, with get2's lanes2).
  template <bool Magic>
  __attribute__((always_inline)) inline void lanes4(int j, __m512i& lo0, __m512i& lo1, __m512i& hi0,
                                                    __m512i& hi1) const {
    static_assert(kLanes);
    const uint8_t* g = q + (j / 4) * 128;
    const __m512i v0 = load64(g), v1 = load64(g + 64);
    const int b = 8 * (j % 4);  // j even: pair vector j + 1 at b + 8
    lo0 = lanes_pair<Magic>(v0, v1, b);
    lo1 = lanes_pair<Magic>(v0, v1, b + 8);
    hi0 = lanes_pair<Magic>(v0, v1, b + 4);
    hi1 = lanes_pair<Magic>(v0, v1, b + 12);
  }
  // Pair vectors j and j + 1 (j even) alone, in either form (the GEMV's chains take them in k order).
  template <bool Magic>
  __attribute__((always_inline)) inline void lanes2(int j, __m512i& g0, __m512i& g1) const {
    static_assert(kLanes);
    const int jj = j & 7;
    const uint8_t* g = q + (jj / 4) * 128;
    const __m512i v0 = load64(g), v1 = load64(g + 64);
    const int b = 8 * (jj % 4) + (j >= 8 ? 4 : 0);
    g0 = lanes_pair<Magic>(v0, v1, b);
    g1 = lanes_pair<Magic>(v0, v1, b + 8);
  }
  // Each lane's nibble at bits at .. at + 3 moved to bits to .. to + 3.
  __attribute__((always_inline)) static inline __m512i nibble_to(__m512i v, int at, int to) {
    if (at < to) return _mm512_slli_epi32(v, static_cast<unsigned>(to - at));
    if (at > to) return _mm512_srli_epi32(v, static_cast<unsigned>(at - to));
    return v;
  }
  // The pair vector of rows 0-7 (v0) and 8-15 (v1) from their lanes' nibbles at bits at .. at + 3.
  template <bool Magic>
  __attribute__((always_inline)) inline __m512i lanes_pair(__m512i v0, __m512i v1, int at) const {
    if constexpr (Magic) {
      return nibbles(nibble_to(v0, at, 16), nibble_to(v1, at, 16));
    } else {  // make's converting form: q * 2^24 (Q4_0: (q - 8) * 2^24) converted exactly, the scales carry 2^-24
      const auto q24 = [&](__m512i v) __attribute__((always_inline)) {
        __m512i i = _mm512_and_si512(nibble_to(v, at, 24), _mm512_set1_epi32(0x0F000000));
        if constexpr (B == kQ4_0) i = _mm512_sub_epi32(i, _mm512_set1_epi32(8 << 24));
        return _mm512_cvtepi32_ps(i);
      };
      const __m512 q0 = q24(v0), q1 = q24(v1);
      __m512 f0, f1;
      if constexpr (B == kQ4_1) {  // d * q + m
        f0 = _mm512_fmadd_ps(q0, d0, m0);
        f1 = _mm512_fmadd_ps(q1, d1, m1);
      } else {
        f0 = _mm512_mul_ps(q0, d0);
        f1 = _mm512_mul_ps(q1, d1);
      }
      return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
    }
  }
#else
  static constexpr bool kNibbles = false;  // get4 is called only where it holds (in if constexpr branches)
  static_assert(!kLanes, "the lane-local packing is read only where VBMI is built (quant_lanes_type)");
  template <bool Magic>
  static constexpr bool quads = false;
  static constexpr bool kMagic = false;
  static constexpr float kSlowUnit = 1.f;
  inline void to_slow() {}
  inline void scales(__m512 D, __m512 m) {
    pairs(D, d0, d1);
    pairs(m, m0, m1);
  }
  template <bool Magic>
  inline __m512i make(__m512i v, int half, bool second) const {
    const __m256i ab = half ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v);
    const __m128i a = _mm256_castsi256_si128(ab), b = _mm256_extracti128_si256(ab, 1);
    const __m128i r0 = _mm_unpacklo_epi8(a, b), r1 = _mm_unpackhi_epi8(a, b);  // rows 0-7, 8-15: (k, k+1)
    __m512 f0, f1;
    if constexpr (B == kQ8_0 || B == kQ4_0 || B == kQ5_0) {  // signed: q, q - 8, q - 16 (get took the offsets)
      f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(r0)), d0);
      f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(r1)), d1);
    } else if constexpr (B == kQ6_K) {  // signed q - 32 already
      f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(r0)), second ? m0 : d0);
      f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(r1)), second ? m1 : d1);
    } else if constexpr (kKScales) {  // d * scale * q - dmin * min
      f0 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(r0)), d0, m0);
      f1 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(r1)), d1, m1);
    } else {  // Q4_1, Q5_1: d * q + m
      f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(r0)), d0, m0);
      f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(r1)), d1, m1);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
  }
#endif

  static inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(p); }

  // Pair vectors j and j + 1 (j even) of the sub-block (the pair vector of j: k = 2 j, 2 j + 1), made from one
  // 64-byte source, the byte planes of j and those of j + 1 side by side, so each op on the quants serves two pair
  // vectors. Magic: in make's magic form (where init set magic). On the lane-local packing: lanes2.
  template <bool Magic>
  inline void get2(int j, __m512i& g0, __m512i& g1) const {
#if defined(__AVX512VBMI__)
    if constexpr (kLanes) {
      lanes2<Magic>(j, g0, g1);
      return;
    }
#endif
    constexpr bool M = Magic && kMagic;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i v;
    if constexpr (B == kQ8_0) {  // byte planes 2 j .. 2 j + 3 (Q8_0's magic form: unsigned, the sign bit flipped)
      v = load64(q + 2 * j * 16);
      if constexpr (M) v = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
    } else if constexpr (B == kQ4_K) {  // byte planes k of the sub-block pair, this sub-block's nibble
      v = _mm512_and_si512(_mm512_srl_epi16(load64(q + 2 * j * 16), sh), low4);
    } else if constexpr (B == kQ5_K) {  // and bit s of qh planes k at bit 4 (16-bit shifts: one bit per byte survives)
      const __m512i nib = _mm512_and_si512(_mm512_srl_epi16(load64(q + 2 * j * 16), sh), low4);
      const __m512i hi = _mm512_slli_epi16(
          _mm512_and_si512(_mm512_srl_epi16(load64(h + 2 * j * 16), hs), _mm512_set1_epi8(0x01)), 4);
      v = _mm512_or_si512(nib, hi);
    } else if constexpr (B == kQ6_K) {  // low 4 bits from ql, bits 4-5 from qh, minus 32
      const __m512i lo = _mm512_and_si512(_mm512_srl_epi16(load64(q + 2 * j * 16), sh), low4);
      const __m512i hi = _mm512_slli_epi16(
          _mm512_and_si512(_mm512_srl_epi16(load64(h + 2 * j * 16), hs), _mm512_set1_epi8(0x03)), 4);
      v = _mm512_sub_epi8(_mm512_or_si512(lo, hi), _mm512_set1_epi8(32));
    } else {
      const int jj = j & 7;  // byte planes 2 jj .. 2 jj + 3: low nibbles k = 2 jj.., high nibbles k = 16 + 2 jj..
      const __m512i raw = load64(q + 2 * jj * 16);
      const __m512i nib = j < 8 ? _mm512_and_si512(raw, low4) : _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      if constexpr (B == kQ5_0 || B == kQ5_1) {
        // Q5_0: q - 16 = nib where the high bit is set, else nib - 16; Q5_1: q = nib + 16 where it is set. k = 2 j,
        // 2 j + 1 (and 2 j + 2, 2 j + 3: pair vector j + 1) take bits b .. b + 3 (b = 2 j % 8) of qh byte plane
        // j / 4: that plane in each 16-byte quarter, tested against its bit (one mask bit per byte).
        const __m512i hp = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + (j / 4) * 16)));
        const int b = (2 * j) % 8;
        const __m512i bit = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi8(static_cast<char>(2 << b)),
                                                    _mm_set1_epi8(static_cast<char>(1 << b)))),
            _mm256_set_m128i(_mm_set1_epi8(static_cast<char>(8 << b)), _mm_set1_epi8(static_cast<char>(4 << b))), 1);
        if constexpr (B == kQ5_1 || M)  // Q5_0's magic form: q + 16 unsigned, as Q5_1's
          v = _mm512_mask_add_epi8(nib, _mm512_test_epi8_mask(hp, bit), nib, _mm512_set1_epi8(16));
        else
          v = _mm512_mask_sub_epi8(nib, _mm512_testn_epi8_mask(hp, bit), nib, _mm512_set1_epi8(16));
      } else if constexpr (B == kQ4_0 && !M) {
        v = _mm512_sub_epi8(nib, _mm512_set1_epi8(8));
      } else {
        v = nib;
      }
    }
    g0 = make<M>(v, 0, j >= 8);
    g1 = make<M>(v, 1, j >= 8);
  }
};

// Inlined into every caller (the two forms' loops made GCC call it out of line for some types: 5% slower).
template <int64_t T>
__attribute__((always_inline)) inline void widen_sub_bf16(const uint8_t* panel, int64_t k0, uint16_t* out) {
  static_assert(FastPairs<T>::kOk);
  FastPairs<T> fp;
  fp.init(panel, k0);
  const auto steps = [&]<bool Magic>() {
    if constexpr (FastPairs<T>::template quads<Magic>) {
      PAGEDSERVE_UNROLL
      for (int j = 0; j < 8; j += 2) {
        __m512i l0, l1, h0, h1;
        fp.template get4x<Magic>(j, l0, l1, h0, h1);
        _mm512_storeu_si512(out + j * 32, l0);
        _mm512_storeu_si512(out + (j + 1) * 32, l1);
        _mm512_storeu_si512(out + (j + 8) * 32, h0);
        _mm512_storeu_si512(out + (j + 9) * 32, h1);
      }
      return;
    }
    PAGEDSERVE_UNROLL
    for (int j = 0; j < 16; j += 2) {
      __m512i g0, g1;
      fp.template get2<Magic>(j, g0, g1);
      _mm512_storeu_si512(out + j * 32, g0);
      _mm512_storeu_si512(out + (j + 1) * 32, g1);
    }
  };
  if (fp.magic) {
    steps.template operator()<true>();
  } else {
    steps.template operator()<false>();
  }
}

// The few-rows kernel (M <= 4): the same chains with the weights widened and paired in registers (no buffer),
// R rows x P panels over all of K (Paired: a gate panel and its up panel, see prefetch_panels).
template <int64_t T, int R, int P, bool Paired = false>
void gemv_bf16_fast(const uint16_t* x, int64_t xs, const uint8_t* panel, int64_t pstride, int64_t K, float* acc) {
  constexpr QuantType t = quant_type(T);
  constexpr int64_t step_bytes = 16 * t.block_bytes * 32 / t.block_size;  // a panel's bytes per 32 k
  __m512 c[R * P];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) c[i] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    FastPairs<T> fp[P];
    bool magic = true;
    PAGEDSERVE_UNROLL
    for (int p = 0; p < P; ++p) {
      fp[p].init(panel + p * pstride, k0);
      magic = magic && fp[p].magic;
    }
    prefetch_panels<P, Paired>(panel, pstride, k0 / 32, step_bytes);
    // The chains' step over the k pair (2 jj, 2 jj + 1) of the sub-block, w[p] panel p's pair vector.
    const auto dots = [&](int jj, const __m512i* w, int wstride) __attribute__((always_inline)) {
      __m512bh a[R];
      PAGEDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * xs + k0 + 2 * jj, 4);
        a[r] = (__m512bh)_mm512_set1_epi32(pair);
      }
      PAGEDSERVE_UNROLL
      for (int p = 0; p < P; ++p) {
        PAGEDSERVE_UNROLL
        for (int r = 0; r < R; ++r) c[r * P + p] = _mm512_dpbf16_ps(c[r * P + p], a[r], (__m512bh)w[p * wstride]);
      }
    };
    const auto steps = [&]<bool Magic>() {
      // Pair vectors j and j + 8 together, j + 8 held; not on the lane-local packing, whose pair vectors come in k
      // order from get2 (lanes2) with none held.
      if constexpr (FastPairs<T>::template quads<Magic> && !FastPairs<T>::kLanes) {
        __m512i held[P][8];
        PAGEDSERVE_UNROLL
        for (int j = 0; j < 8; j += 2) {
          __m512i wv[P][2];
          PAGEDSERVE_UNROLL
          for (int p = 0; p < P; ++p) fp[p].template get4x<Magic>(j, wv[p][0], wv[p][1], held[p][j], held[p][j + 1]);
          dots(j, &wv[0][0], 2);
          dots(j + 1, &wv[0][1], 2);
        }
        PAGEDSERVE_UNROLL
        for (int j = 0; j < 8; ++j) dots(j + 8, &held[0][j], 8);
        return;
      }
      PAGEDSERVE_UNROLL
      for (int j = 0; j < 16; j += 2) {
        __m512i wv[P][2];
        PAGEDSERVE_UNROLL
        for (int p = 0; p < P; ++p) fp[p].template get2<Magic>(j, wv[p][0], wv[p][1]);
        dots(j, &wv[0][0], 2);
        dots(j + 1, &wv[0][1], 2);
      }
    };
    if (magic) {
      steps.template operator()<true>();
    } else {
      PAGEDSERVE_UNROLL
      for (int p = 0; p < P; ++p) fp[p].to_slow();
      steps.template operator()<false>();
    }
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) _mm512_storeu_ps(acc + (i / P) * P * 16 + (i % P) * 16, c[i]);
}

template <int64_t T, int P, bool Paired = false>
inline void gemv_bf16_rows(int64_t R, const uint16_t* x, int64_t xs, const uint8_t* panel, int64_t pstride, int64_t K,
                           float* acc) {
  switch (R) {
    case 1: gemv_bf16_fast<T, 1, P, Paired>(x, xs, panel, pstride, K, acc); break;
    case 2: gemv_bf16_fast<T, 2, P, Paired>(x, xs, panel, pstride, K, acc); break;
    case 3: gemv_bf16_fast<T, 3, P, Paired>(x, xs, panel, pstride, K, acc); break;
    default: gemv_bf16_fast<T, 4, P, Paired>(x, xs, panel, pstride, K, acc); break;
  }
}

// Greedy decoding's epilogue (quant_linear_bf16_argmax): instead of writing its rows' float32 sums (a [rows, vocab]
// tensor that the sampler then reads back: at W1's 128 rows a 25 MB write and read, ~3 ms of a ~59 ms decode step),
// a matmul hands them here, 16 columns at a time, and each thread keeps per row and lane the largest sum so far and
// its column, taken only by a larger sum (the drivers hand a thread's columns of a row over in increasing order, so
// a lane keeps its first maximum); a NaN marks the row. result() reduces the threads' lanes: per row the lowest
// column holding the largest sum (torch.argmax's and argmax_rows' index over the same float32 logits), or -1 where a
// sum is NaN (the sampler names such a row instead of sampling it).
class RowArgmax {
 public:
  RowArgmax(int64_t M, int64_t threads)
      : M_(M), best_(threads * M * 16, -std::numeric_limits<float>::infinity()), col_(threads * M * 16, 0),
        nan_(threads * M, 0) {}

  // `rows` rows from row r (sums at acc, row stride as) of np panels from panel p0 (panel j's 16 at 16 j), plus bias;
  // N columns in all. Thread t's lanes (the caller's at::get_thread_num()).
  void update(int64_t t, const float* acc, int64_t as, int64_t rows, int64_t r, int np, int64_t p0, const float* bias,
              int64_t N) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t at = t * M_ + r + i;
      float* b = best_.data() + at * 16;
      int32_t* c = col_.data() + at * 16;
      __m512 vb = _mm512_loadu_ps(b);
      __m512i vc = _mm512_loadu_si512(c);
      __mmask16 nan = 0;
      for (int j = 0; j < np; ++j) {
        const int64_t n0 = (p0 + j) * 16;
        const __mmask16 live = first_lanes(N - n0);
        __m512 v = _mm512_maskz_loadu_ps(live, acc + i * as + 16 * j);
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias + n0));
        const __mmask16 take = _mm512_mask_cmp_ps_mask(live, v, vb, _CMP_GT_OQ);
        vb = _mm512_mask_mov_ps(vb, take, v);
        vc = _mm512_mask_mov_epi32(vc, take, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(n0))));
        nan |= _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
      }
      _mm512_storeu_ps(b, vb);
      _mm512_storeu_si512(c, vc);
      if (nan) nan_[at] = 1;
    }
  }

  // int64 [M]: each row's argmax over every thread's lanes (-1: a NaN sum).
  torch::Tensor result() const {
    auto out = torch::empty({M_}, torch::kInt64);
    int64_t* o = out.data_ptr<int64_t>();
    const int64_t threads = static_cast<int64_t>(nan_.size()) / std::max<int64_t>(1, M_);
    for (int64_t r = 0; r < M_; ++r) {
      float best = -std::numeric_limits<float>::infinity();
      int64_t col = std::numeric_limits<int32_t>::max();
      bool nan = false;
      for (int64_t t = 0; t < threads; ++t) {
        const int64_t at = t * M_ + r;
        nan = nan || nan_[at];
        for (int l = 0; l < 16; ++l) {  // a lane no sum reached (-inf, column 0) loses to any other
          const float v = best_[at * 16 + l];
          const int64_t c = col_[at * 16 + l];
          if (v > best || (v == best && c < col)) {
            best = v;
            col = c;
          }
        }
      }
      o[r] = nan ? -1 : col;
    }
    return out;
  }

 private:
  int64_t M_;
  std::vector<float> best_;
  std::vector<int32_t> col_;
  std::vector<uint8_t> nan_;
};

// The panel groups of a many-rows bf16 matmul (both routes' drivers): groups of kBfPanels panels (64 output columns),
// each widened into a bf16 pair buffer, one slot of K * 16 per panel. With Silu, W is [gate; up] (N = 2 I, I % 16 ==
// 0) and y is [M, I]: a group holds the gate panels and the up panels of the same columns (up in slots kBfPanels..),
// and its sums are written as silu(gate) * up, each rounded to bf16 where silu_and_mul over the bf16 matmul rounds
// it (the same bits as the two ops, without writing and re-reading the [M, 2 I] product). A work item's sums are
// `as` floats per row: slot s's 16 columns at 16 s.
template <int64_t T, typename OT, bool Silu>
struct PanelGroups {
  static constexpr int sides = Silu ? 2 : 1;
  static constexpr int64_t slots = sides * kBfPanels, as = slots * 16;
  const uint8_t* w;
  const float* bias;
  OT* y;
  RowArgmax* argmax;  // non-null: the rows' sums go there instead of y (no Silu)
  int64_t N, K, pstride, panels, up0, groups;

  PanelGroups(const uint8_t* w_, const float* bias_, OT* y_, int64_t N_, int64_t K_, RowArgmax* argmax_ = nullptr)
      : w(w_), bias(bias_), y(y_), argmax(argmax_), N(N_), K(K_),
        pstride(16 * (K_ / quant_type(T).block_size) * quant_type(T).block_bytes),
        panels(Silu ? N_ / 32 : (N_ + 15) / 16),  // per side
        up0(Silu ? N_ / 32 : 0),                  // the first up panel
        groups((panels + kBfPanels - 1) / kBfPanels) {}

  // Panels of the group starting at panel p0 (per side).
  int np(int64_t p0) const { return static_cast<int>(std::min<int64_t>(kBfPanels, panels - p0)); }
  // Slot s of group g widened into dst (nothing past the last panel).
  void widen_slot(int64_t g, int64_t s, uint16_t* dst) const {
    const int64_t p = g * kBfPanels + s % kBfPanels;
    if (p < panels) widen_panel_bf16<T>(w + (s < kBfPanels ? p : up0 + p) * pstride, K, dst);
  }
  void widen(int64_t g, uint16_t* buf) const {
    for (int64_t s = 0; s < slots; ++s) widen_slot(g, s, buf + s * K * 16);
  }
#ifdef PAGEDSERVE_AVX512
  // With Silu, one row's panel j (16 outputs) of write() below: row i of acc, output row r, the group at panel p0.
  void write_silu_one(const float* acc, int64_t i, int j, int64_t r, int64_t p0) const {
    static_assert(Silu);
    silu_store16(acc + i * as + j * 16, kBfPanels * 16, y + r * (N / 2) + (p0 + j) * 16);
  }
#endif
  // The sums of `rows` rows from row r (acc, row stride as) of the group starting at panel p0.
  void write(const float* acc, int64_t rows, int64_t r, int64_t p0) const {
    if constexpr (Silu) {
      write_silu(acc, as, rows, np(p0), p0, y + r * (N / 2), N / 2, kBfPanels * 16);
    } else if (argmax) {
      argmax->update(at::get_thread_num(), acc, as, rows, r, np(p0), p0, bias, N);
    } else {
      write_panels(acc, as, rows, np(p0), p0, bias, y + r * N, N);
    }
  }
};

// ---- the same weights on AMX tiles (Sapphire Rapids and later): quant_linear_bf16 where AMX is ---------------
//
// The pair buffer above is AMX's B tile layout as it is: rows = k pairs, 16 columns of (k, k+1) bf16 pairs. So
// a 32-k step of one panel is one B tile (1 KB), 16 rows of x over the same 32 k are one A tile (read in place,
// row stride xs) and TDPBF16PS adds their product into a 16 x 16 float32 C tile. Every output is the chain of
// TDPBF16PS steps over k = 0, 32, 64, ... in order, started at 0 -- whatever M, the row's place in a tile, the
// tile's rows or the thread count -- so the route is batch-invariant as the vdpbf16ps one is. Its bits are not
// the vdpbf16ps chain's (TDPBF16PS sums a step's 32 products its own way; no order of FMAs reproduces it, checked
// on a Sapphire Rapids), so a process uses one route for every row count: AMX where the CPU has it and the
// kernel grants the tile state (amx_active), else vdpbf16ps. set_amx(false) forces the latter.
//
// Tiles (amx.h's configuration): C 0-3 (row tile a, panel b at 2 a + b), A 4-5, B 6-7. A and C tiles have `rows`
// rows (1-16): a block of rows below 16 is configured to its size instead of padded.
#ifdef PAGEDSERVE_QUANT_AMX

struct NoSideWork {
  void operator()() {}
};

// C tiles (RT row tiles x PT panels) = x rows . buf panels over all of K, stored into acc (row stride as floats).
// buf: PT panels of K * 16 bf16 each (the pair layout); x: RT * rows rows of bf16 (row stride xs).
// With ka > 0 the C tiles continue the chains stored in acc by the call for the k before ka (a float32 tile stored
// and loaded back is the same bits), so a K-blocked loop gives the unblocked chains exactly.
// side() runs after each 32-k step's tile products are issued: vector work (another item's epilogue:
// AmxLaterWrites) that the core's vector ports do while the tile unit multiplies (they overlap: a 4-product step
// with ~60 FMAs beside it takes as long as the step alone on a Sapphire Rapids).
// StreamB: the B tiles loaded with the non-temporal hint (TILELOADDT1), so that they pass by L1 and the A tiles the
// caller keeps there stay (the same values: the same bits).
template <int RT, int PT, bool StreamB = false, typename SW = NoSideWork>
inline void amx_block(const uint16_t* x, int64_t xs, int rows, const uint16_t* buf, int64_t K, float* acc,
                      int64_t as, int64_t ka = 0, int64_t kz = -1, SW&& side = {}) {
  const int64_t cb = as * 4;
  if (kz < 0) kz = K;
  if (ka == 0) {
    _tile_zero(0);
    if constexpr (PT > 1) _tile_zero(1);
    if constexpr (RT > 1) _tile_zero(2);
    if constexpr (RT > 1 && PT > 1) _tile_zero(3);
  } else {
    _tile_loadd(0, acc, cb);
    if constexpr (PT > 1) _tile_loadd(1, acc + 16, cb);
    if constexpr (RT > 1) _tile_loadd(2, acc + rows * as, cb);
    if constexpr (RT > 1 && PT > 1) _tile_loadd(3, acc + rows * as + 16, cb);
  }
  const int64_t xb = xs * 2, ps = K * 16;
  const uint16_t* x1 = x + rows * xs;
  for (int64_t k0 = ka; k0 < kz; k0 += 32) {
    if constexpr (StreamB) {
      _tile_stream_loadd(6, buf + k0 * 16, 64);
      if constexpr (PT > 1) _tile_stream_loadd(7, buf + ps + k0 * 16, 64);
    } else {
      _tile_loadd(6, buf + k0 * 16, 64);
      if constexpr (PT > 1) _tile_loadd(7, buf + ps + k0 * 16, 64);
    }
    _tile_loadd(4, x + k0, xb);
    if constexpr (RT > 1) _tile_loadd(5, x1 + k0, xb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT > 1 && PT > 1) _tile_dpbf16ps(3, 5, 7);
    side();
  }
  _tile_stored(0, acc, cb);
  if constexpr (PT > 1) _tile_stored(1, acc + 16, cb);
  if constexpr (RT > 1) _tile_stored(2, acc + rows * as, cb);
  if constexpr (RT > 1 && PT > 1) _tile_stored(3, acc + rows * as + 16, cb);
}

inline void amx_block_any(int RT, int PT, const uint16_t* x, int64_t xs, int rows, const uint16_t* buf, int64_t K,
                          float* acc, int64_t as) {
  if (RT > 1) {
    if (PT > 1) amx_block<2, 2>(x, xs, rows, buf, K, acc, as); else amx_block<2, 1>(x, xs, rows, buf, K, acc, as);
  } else {
    if (PT > 1) amx_block<1, 2>(x, xs, rows, buf, K, acc, as); else amx_block<1, 1>(x, xs, rows, buf, K, acc, as);
  }
}

// Up to 16 rows (M of them: the tiles are configured to M rows) against P panels, the weights widened one 32-k
// step at a time into a B tile buffer (two, alternating, so a widening does not wait on the last tile load).
// Paired: a gate panel and its up panel (see prefetch_panels).
template <int64_t T, int P, bool Paired = false>
void gemv_amx(const uint16_t* x, int64_t xs, const uint8_t* panel, int64_t pstride, int64_t K, float* acc,
              int64_t as) {
  constexpr QuantType t = quant_type(T);
  constexpr int64_t step_bytes = 16 * t.block_bytes * 32 / t.block_size;
  alignas(64) uint16_t bb[2][P][16 * 32];
  _tile_zero(0);
  if constexpr (P > 1) _tile_zero(1);
  const int64_t xb = xs * 2;
  const auto widen = [&](int64_t k0, uint16_t(*b)[16 * 32]) {
    prefetch_panels<P, Paired>(panel, pstride, k0 / 32, step_bytes);
    PAGEDSERVE_UNROLL
    for (int p = 0; p < P; ++p) widen_sub_bf16<T>(panel + p * pstride, k0, b[p]);
  };
  widen(0, bb[0]);
  for (int64_t k0 = 0, i = 0; k0 < K; k0 += 32, ++i) {
    uint16_t(*b)[16 * 32] = bb[i & 1];
    if (k0 + 32 < K) widen(k0 + 32, bb[(i + 1) & 1]);  // a step ahead: the tile loads below find b's stores done
    _tile_loadd(4, x + k0, xb);
    _tile_loadd(6, b[0], 64);
    if constexpr (P > 1) _tile_loadd(7, b[1], 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (P > 1) _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, acc, as * 4);
  if constexpr (P > 1) _tile_stored(1, acc + 16, as * 4);
}

constexpr int64_t kAmxGemvRows = 16;  // up to here: one row tile, weights streamed
constexpr int64_t kAmxKBlockBytes = 36864;  // B-major: a k block's B (panel pair) and A (row pair) tiles, in L1
constexpr int64_t kAmxABytes = 40960;       // A-major: a row pair's A tiles over all of K, in L1 (K <= 640)
constexpr int64_t kAmxWideBytes = 4 << 20;  // the many-rows route's shared widened weights at a time
constexpr int64_t kAmxXBytes = 1 << 20;     // up to here x stays in L2: groups split, widened per thread

// The fused SwiGLU's epilogue on the many-rows AMX route, done beside the tile products of the next work item
// (amx_block's side work) instead of between items: e^x and the rest of silu_mul16 for each output are ~50 vector
// instructions, ~30% of the call when done after the products (2,048 x 3,072 x 576 on a Sapphire Rapids: 3.85 ms,
// 2.5 ms without the epilogue), and the vector ports are idle while the tile unit multiplies. Per tile step a share of
// the previous item's outputs (spread evenly over this item's steps), the rest when the item ends; each output is
// computed once and in full, so the bits are unchanged. (The plain matmuls' epilogue, a rounding and a store per 16
// outputs, gained nothing this way: their stores then compete with the tiles' loads.)
template <typename PG>
struct AmxLaterWrites {
  const PG& pg;
  // pending: rows [0, rows) of acc to output rows m0.., the group at panel p0; unit u = (row u / np, panel u % np)
  const float* acc = nullptr;
  int64_t m0 = 0, p0 = 0, u = 0, n = 0;
  int np = 1;
  int64_t steps = 1, share = 0, frac = 0;  // this item's: per step, share / steps units (error-diffused)

  explicit AmxLaterWrites(const PG& pg_) : pg(pg_) {}
  void units(int64_t k) {
    for (; k > 0 && u < n; --k, ++u) {
      const int64_t i = u / np;
      pg.write_silu_one(acc, i, static_cast<int>(u % np), m0 + i, p0);
    }
  }
  // The outputs of `rows` rows of acc (rows from m0_, the group at p0_), from now on.
  void later(const float* acc_, int64_t rows, int64_t m0_, int64_t p0_) {
    acc = acc_, m0 = m0_, p0 = p0_, np = pg.np(p0_), u = 0, n = rows * np;
  }
  // An item of k tile steps starts: what is pending is spread over them.
  void begin(int64_t k) { steps = std::max<int64_t>(1, k), share = n - u, frac = 0; }
  void operator()() {
    frac += share;
    if (frac >= steps) {
      units(frac / steps);
      frac %= steps;
    }
  }
  void finish() { units(n - u); }
};

// The next group's packed weights into L2 during this group's tile products (amx_block's side work) where each
// thread widens its own groups: a share of the lines after each 32-k step. The weights of a matmul at a decode step's
// rows come from memory (the step's K/V reads pass through the caches between layers), and a group's widening
// otherwise waits on them before its tile products start.
struct GroupPrefetch {
  const uint8_t* p[2] = {nullptr, nullptr};
  int64_t left[2] = {0, 0}, per = 0;  // bytes left in each range; lines per call
  void start(const uint8_t* a, int64_t an, const uint8_t* b, int64_t bn) {
    p[0] = a, p[1] = b, left[0] = an, left[1] = bn;
  }
  void spread(int64_t calls) {
    const int64_t c = std::max<int64_t>(1, calls);
    per = (left[0] + left[1] + 64 * c - 1) / (64 * c);
  }
  void operator()() {
    for (int64_t k = per; k > 0; --k) {
      const int r = left[0] > 0 ? 0 : 1;
      if (left[r] <= 0) return;
      _mm_prefetch(reinterpret_cast<const char*>(p[r]), _MM_HINT_T1);
      p[r] += 64;
      left[r] -= 64;
    }
  }
};

// Where each thread widens its own groups (a decode step's rows), the output lines of an item (`rows` rows of `bytes`
// from base, row stride `stride` bytes) asked for in the exclusive state (prefetchw) during its tile products, a
// share at a time: the output buffer is not in L2 there (the step's K/V reads pass through between its uses), and
// the item's writes otherwise each wait on a read for ownership. W1 +3.4% on a Sapphire Rapids. (Not on the
// prefill-sized route: W3 measured no gain, rather a loss, there.)
struct OutPrefetch {
  char* base = nullptr;
  int64_t stride = 0, bytes = 0, rows = 0, r = 0, per = 0;
  void start(void* b, int64_t s, int64_t nbytes, int64_t nrows, int64_t calls) {
    base = static_cast<char*>(b), stride = s, bytes = nbytes, rows = nrows, r = 0;
    per = (nrows + std::max<int64_t>(1, calls) - 1) / std::max<int64_t>(1, calls);
  }
  void operator()() {
    for (int64_t k = per; k > 0 && r < rows; --k, ++r)
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(base + r * stride + o, 1, 3);
  }
};

// The many-rows AMX matmul (M > kAmxGemvRows); with Silu, the fused SwiGLU (see PanelGroups).
template <int64_t T, typename OT, bool Silu = false>
void quant_gemm_amx_rows(const uint16_t* x, int64_t xs, const uint8_t* w, const float* bias, OT* y, int64_t M,
                         int64_t N, int64_t K, RowArgmax* argmax = nullptr) {
  // Work items of (a block of rows, a panel group: PanelGroups) over the group's widened weights. Pairs of full row
  // tiles against pairs of panels; one operand stays in L1 while the other streams past it: a tile load from L2 does
  // not overlap the tile products before it (no tile renaming), so with both operands from L2 a 2 x 2 step took
  // ~1.3x as long as with one in L1 (C microbenchmark, Sapphire Rapids).
  // - A-major, where a row pair's A tiles over all of K fit (K <= 640: SmolLM2's and Gemma 3's hidden sizes) on the
  //   prefill-sized route, and for the fused SwiGLU (8 slots: 4 panel pairs per A) on the decode-sized one: they
  //   stay while the item's panel pairs pass over all of K, the B tiles loaded past L1 (StreamB), C in the tiles
  //   throughout. Against B-major: SmolLM2's gate_up, qkv, o 1-13% faster at 2,048 rows and its gate_up 6-11% at
  //   128; Gemma 3's gate_up and qkv at 2,048 rows 13% and 9%.
  // - B-major (a longer K; the plain matmuls at a decode step's rows): K-blocked, C going to acc between k blocks;
  //   per k block a panel pair's B (kc x 32 bf16; with a row pair's A, 36 KB) stays while the row pairs' A tiles
  //   pass. A-major measured slower there: the LM head at W1's 128 rows 4.7 -> 5.2 ms, qkv and o within 3%, and in
  //   k blocks the down projections (SmolLM2's, K = 1,536, at 2,048 rows 1.83 -> 2.00 ms; Gemma 3's, K = 2,048,
  //   8-11%).
  // With Silu, an item's full row pairs are written during the next item's tile products (AmxLaterWrites; a
  // thread's items alternate between two acc buffers), the last when the task ends.
  using PG = PanelGroups<T, OT, Silu>;
  using LW = AmxLaterWrites<PG>;
  const PG pg(w, bias, y, N, K, argmax);
  constexpr int sides = PG::sides;
  constexpr int64_t as = PG::as, slots = PG::slots;
  const int64_t groups = pg.groups;
  const int64_t gsize = slots * K * 16;  // bf16 per group
  const int64_t nkb = std::max<int64_t>(1, (K * 128 + kAmxKBlockBytes - 1) / kAmxKBlockBytes);
  const int64_t kc = ((K + nkb - 1) / nkb + 31) / 32 * 32;  // B-major's k block
  // ahead: the route where each thread widens its own groups (a decode step's rows), which asks for the next group's
  // weights and this item's outputs ahead (nullptr: the prefill-sized route, nothing asked ahead).
  auto item = [&](const uint16_t* buf, int64_t m0, int64_t mb, int64_t p0, float* acc, amx::Tiles& tiles, LW& lw,
                  GroupPrefetch* ahead) {
    const int np = pg.np(p0);
    const int64_t full = mb / 32 * 32;
    const int64_t steps = (K / 32) * sides * ((np + 1) / 2) * (full / 32);
    if constexpr (Silu) lw.begin(steps);
    GroupPrefetch none;
    GroupPrefetch& pf = ahead ? *ahead : none;
    pf.spread(steps);
    OutPrefetch op;
    if (ahead && !argmax) {
      const int64_t yn = Silu ? N / 2 : N, sz = static_cast<int64_t>(sizeof(OT));
      op.start(y + m0 * yn + p0 * 16, yn * sz, std::min<int64_t>(np * 16, yn - p0 * 16) * sz, mb, steps);
    }
    if (full) {
      tiles.use(16);
      // Row pair r0 against slot pair j (its second slot when j + 1 < the side's end) over k in [ka, kz).
      auto run = [&](int64_t r0, int side, int j, int64_t ka, int64_t kz, auto stream_b) {
        constexpr bool SB = decltype(stream_b)::value;
        const bool pair = side * kBfPanels + np - j >= 2;
        const uint16_t* xr = x + (m0 + r0) * xs;
        float* c = acc + r0 * as + j * 16;
        auto block = [&](auto&& work) {
          if (pair) {
            amx_block<2, 2, SB>(xr, xs, 16, buf + j * K * 16, K, c, as, ka, kz, work);
          } else {
            amx_block<2, 1, SB>(xr, xs, 16, buf + j * K * 16, K, c, as, ka, kz, work);
          }
        };
        block([&] {
          if constexpr (Silu) lw();
          pf();
          op();
        });
      };
      if ((Silu || !ahead) && K * 64 <= kAmxABytes) {  // A-major (ahead: the decode-sized route)
        for (int64_t r0 = 0; r0 < full; r0 += 32)
          for (int side = 0; side < sides; ++side)
            for (int j = side * kBfPanels; j < side * kBfPanels + np; j += 2) run(r0, side, j, 0, K, std::true_type{});
      } else {
        for (int64_t ka = 0; ka < K; ka += kc) {
          for (int side = 0; side < sides; ++side)
            for (int j = side * kBfPanels; j < side * kBfPanels + np; j += 2)
              for (int64_t r0 = 0; r0 < full; r0 += 32) run(r0, side, j, ka, std::min(K, ka + kc), std::false_type{});
        }
      }
    }
    if constexpr (Silu) {
      lw.finish();
      if (full) lw.later(acc, full, m0, p0);
    } else if (full) {
      pg.write(acc, full, m0, p0);
    }
    for (int64_t r0 = full; r0 < mb;) {  // one full row tile, or the last rows (below 16) alone, written at once
      const int rows = static_cast<int>(std::min<int64_t>(16, mb - r0));
      tiles.use(rows);
      for (int side = 0; side < sides; ++side) {
        for (int j = side * kBfPanels; j < side * kBfPanels + np; j += 2) {
          const int PT = std::min<int>(2, static_cast<int>(side * kBfPanels + np - j));
          amx_block_any(1, PT, x + (m0 + r0) * xs, xs, rows, buf + j * K * 16, K, acc + r0 * as + j * 16, as);
        }
      }
      pg.write(acc + r0 * as, rows, m0 + r0, p0);
      r0 += rows;
    }
  };
  if (M * K * 2 <= kAmxXBytes) {
    // x fits in L2 beside the rest: the threads split the groups, each widening its own into a private buffer.
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      Scratch s0(M * as), s1(Silu ? M * as : 0);
      std::vector<uint16_t> bv;
      uint16_t* buf = align64(bv, gsize);
      amx::Tiles tiles;
      LW lw(pg);
      GroupPrefetch pf;
      for (int64_t g = g0; g < g1; ++g) {
        pg.widen(g, buf);
        if (g + 1 < g1) {  // the next group's panels: gate (or all) and, with Silu, up
          const int64_t p1 = (g + 1) * kBfPanels, bytes = pg.np(p1) * pg.pstride;
          pf.start(w + p1 * pg.pstride, bytes, Silu ? w + (pg.up0 + p1) * pg.pstride : nullptr, Silu ? bytes : 0);
        }
        item(buf, 0, M, g * kBfPanels, Silu && (g - g0) % 2 ? s1.p : s0.p, tiles, lw, &pf);
      }
      if constexpr (Silu) lw.finish();
    });
    return;
  }
  // More x: split by groups, each thread would read all of x from memory once per group (~2x the time at 2,048
  // rows). Instead the weights are widened into a buffer shared by the threads, up to kAmxWideBytes of them (a
  // chunk of groups) at a time, all panels of a chunk in parallel; then the items run row-block-major, equal row
  // blocks of up to ~320 KB of x in a multiple of the thread count: a thread's x block stays in L2 while the
  // chunk's groups pass.
  const int64_t G = std::clamp<int64_t>(kAmxWideBytes / (2 * gsize), 1, groups);
  const int64_t nt = at::get_num_threads();
  const int64_t max_mb = std::max<int64_t>(32, (327680 / (2 * K)) / 32 * 32);
  const int64_t mblocks = ((M + max_mb - 1) / max_mb + nt - 1) / nt * nt;
  const int64_t MB = ((M + mblocks - 1) / mblocks + 31) / 32 * 32;
  thread_local std::vector<uint16_t> wide_v;  // kept across calls (resizing down keeps its memory)
  uint16_t* const wide = align64(wide_v, G * gsize);
  for (int64_t g0 = 0; g0 < groups; g0 += G) {
    const int64_t gn = std::min(G, groups - g0);
    at::parallel_for(0, gn * slots, 1, [&](int64_t q0, int64_t q1) {
      for (int64_t q = q0; q < q1; ++q) pg.widen_slot(g0 + q / slots, q % slots, wide + q * K * 16);
    });
    at::parallel_for(0, mblocks * gn, 1, [&](int64_t i0, int64_t i1) {
      Scratch s0(MB * as), s1(Silu ? MB * as : 0);
      amx::Tiles tiles;
      LW lw(pg);
      for (int64_t it = i0; it < i1; ++it) {
        const int64_t m0 = (it / gn) * MB, gi = it % gn;
        if (m0 < M)
          item(wide + gi * gsize, m0, std::min(MB, M - m0), (g0 + gi) * kBfPanels, Silu && (it - i0) % 2 ? s1.p : s0.p, tiles,
               lw, nullptr);
      }
      if constexpr (Silu) lw.finish();
    });
  }
}

template <int64_t T, typename OT>
void quant_gemm_amx(const uint16_t* x, int64_t xs, const uint8_t* w, const float* bias, OT* y, int64_t M, int64_t N,
                    int64_t K) {
  constexpr QuantType t = quant_type(T);
  const int64_t panels = (N + 15) / 16, pstride = 16 * (K / t.block_size) * t.block_bytes;
  if (M <= kAmxGemvRows) {
    gemv_groups<kAmxGemvRows>(
        M, 2, panels, w, pstride, bias, y, N,
        [&](int np, int64_t p0, float* acc) {
          if (np == 2) {
            gemv_amx<T, 2>(x, xs, w + p0 * pstride, pstride, K, acc, 32);
          } else {
            gemv_amx<T, 1>(x, xs, w + p0 * pstride, pstride, K, acc, 16);
          }
        },
        [&] { return amx::Tiles(static_cast<int>(M)); });
    return;
  }
  quant_gemm_amx_rows<T, OT>(x, xs, w, bias, y, M, N, K);
}
#endif


// The many-rows vdpbf16ps matmul (M > kGemvRows); with Silu, the fused SwiGLU (see PanelGroups). Work items of (a
// panel group, a block of ~384 KB of rows of x), the group's weights widened once per run of items of the same group
// (a thread's items are consecutive), then kBfRows x kBfPanels register tiles over all of K.
template <int64_t T, typename OT, bool Silu = false>
void quant_gemm_bf16_rows(const uint16_t* x, int64_t xs, const uint8_t* w, const float* bias, OT* y, int64_t M,
                          int64_t N, int64_t K, RowArgmax* argmax = nullptr) {
  using PG = PanelGroups<T, OT, Silu>;
  const PG pg(w, bias, y, N, K, argmax);
  // Row blocks of up to ~384 KB of x, so that each group's widening is shared by many rows, of equal size (in whole
  // tiles): a block of a few leftover rows would run as a short item beside full ones. Few items (a decode step's
  // small matrices: 9 or 15 groups) that the threads cannot share evenly leave one idle at the end (5 of 9 items on
  // one of 2 threads: 10% of the matmul), so there the rows are cut into as many more blocks as make the item count a
  // multiple of the thread count. (An output's chain is the same in any row block; a group whose items two threads
  // share is widened by both.)
  const int64_t nt = at::get_num_threads(), max_mb = std::max<int64_t>(kBfRows, 393216 / (2 * K));
  int64_t mblocks = (M + max_mb - 1) / max_mb;
  if (pg.groups * mblocks < 8 * nt)
    while ((pg.groups * mblocks) % nt != 0 && (mblocks + 1) * kBfRows <= M) ++mblocks;
  const int64_t MB = ((M + mblocks - 1) / mblocks + kBfRows - 1) / kBfRows * kBfRows;
  mblocks = (M + MB - 1) / MB;
  at::parallel_for(0, pg.groups * mblocks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint16_t> bv;
    uint16_t* buf = align64(bv, PG::slots * K * 16);
    int64_t widened = -1;
    alignas(64) float acc[kBfRows * PG::as];
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t g = it / mblocks, m0 = (it % mblocks) * MB, mb = std::min(MB, M - m0), p0 = g * kBfPanels;
      if (widened != g) {
        pg.widen(g, buf);
        widened = g;
      }
      for (int64_t r0 = 0; r0 < mb; r0 += kBfRows) {
        const int64_t R = std::min(kBfRows, mb - r0);
        for (int side = 0; side < PG::sides; ++side)
          bf16_tile_any(R, pg.np(p0), x + (m0 + r0) * xs, xs, buf + side * kBfPanels * K * 16, K,
                        acc + side * kBfPanels * 16, PG::as);
        pg.write(acc, R, m0 + r0, p0);
      }
    }
  });
}

template <int64_t T, typename OT>
void quant_gemm_bf16(const uint16_t* x, int64_t xs, const uint8_t* w, const float* bias, OT* y, int64_t M, int64_t N,
                     int64_t K) {
#ifdef PAGEDSERVE_QUANT_AMX
  if (amx_active()) {
    quant_gemm_amx<T, OT>(x, xs, w, bias, y, M, N, K);
    return;
  }
#endif
  constexpr QuantType t = quant_type(T);
  const int64_t panels = (N + 15) / 16, pstride = 16 * (K / t.block_size) * t.block_bytes;
  if (M <= kGemvRows) {
    gemv_groups(M, 2, panels, w, pstride, bias, y, N, [&](int np, int64_t p0, float* acc) {
      if (np == 2) {
        gemv_bf16_rows<T, 2>(M, x, xs, w + p0 * pstride, pstride, K, acc);
      } else {
        gemv_bf16_rows<T, 1>(M, x, xs, w + p0 * pstride, pstride, K, acc);
      }
    });
    return;
  }
  quant_gemm_bf16_rows<T, OT>(x, xs, w, bias, y, M, N, K);
}

// The bf16 route this process runs (AMX tiles where amx_active, else vdpbf16ps) for the fused entry points (the
// SwiGLU, the greedy argmax): up to `few` rows its few-rows kernels, above them its many-rows driver (rows()).
struct Bf16Route {
  bool amx = false;
  int64_t few = kGemvRows;
  Bf16Route() {
#ifdef PAGEDSERVE_QUANT_AMX
    if (amx_active()) {
      amx = true;
      few = kAmxGemvRows;
    }
#endif
  }
  template <int64_t T, typename OT, bool Silu = false>
  void rows(const uint16_t* x, int64_t xs, const uint8_t* w, const float* bias, OT* y, int64_t M, int64_t N, int64_t K,
            RowArgmax* argmax = nullptr) const {
#ifdef PAGEDSERVE_QUANT_AMX
    if (amx) {
      quant_gemm_amx_rows<T, OT, Silu>(x, xs, w, bias, y, M, N, K, argmax);
      return;
    }
#endif
    quant_gemm_bf16_rows<T, OT, Silu>(x, xs, w, bias, y, M, N, K, argmax);
  }
};

// ---- the screened greedy head on the bf16 route (Q8_0 weights, AVX512-VNNI, no AMX): quant_linear_bf16_argmax ----
//
// At many rows the bf16 head is bound by its vdpbf16ps (32 multiply-adds per instruction); an int8 screen with VNNI's
// vpdpbusd (64) bounds every logit, and only the panels whose columns can hold a row's maximum get their exact bf16
// chains (the float32 route's quant_linear_argmax scheme, above, for the bf16 route's logits):
//   - x's row (bf16) to int8 per 32-k block b: dx_b = max_b |x| / 127, qx = round(x * (127 / max_b |x|)), so that
//     |x - dx_b qx| <= 0.5001 dx_b (the two scales' roundings: < 2^-21 dx_b); a block below 2^-100 gets no quants;
//   - I_b = sum qx_k q_k exact in int32 (vpdpbusd of qx + 128, unsigned, against the signed quants gives I_b + 128 Q_b,
//     Q_b = sum q), then s = sum_b fl(fl(d_b I_b) dx_b) in float32 (fmsub(I_b + 128 Q_b, d_b, 128 d_b Q_b) rounds d_b
//     I_b once: 128 d_b Q_b and the conversion are exact);
//   - y, the logit: ONE vdpbf16ps chain over x and the bf16 weights w~ = bf16(d q), |w~ - w| <= 2^-9 |w|, K roundings
//     each within 2^-24 of a partial sum (<= sum |x w~|); sum_k |x_k| |w_k| <= 127.0001 sum_b dx_b L1_b, L1_b = sum of
//     |w| over the block (quant_screen_i8_norms: rounded up). So
//       |s - y| <= B = c * sum_b e_b L1_b,  c = 1.02 (0.5001 + 127.0001 (2^-9 + 1.01 (K + 2 nb + 4) 2^-24)),
//     e_b = max(dx_b, 2^-60) (the floor covers the unquantized blocks and the flushes of denormal inputs and sums:
//     < 2^-116 each; 1.02: B's own roundings); the row's max |x| must lie in [2^-60, 2^64) (else every exact logit,
//     as for a non-finite x);
//   - a column whose s + B is below some column's s - B cannot hold the row's maximum (y_max >= that column's y >=
//     its s - B), and the maximum's columns always reach every such lower bound (their s + B >= y_max). The tile loop
//     keeps only s; per row and panel Bl >= B (the panel's largest L1_b of each block) rules out most panels with one
//     add, and only the others get their columns' B (SmolLM2's W1 rows: ~50 of 3,072 panels per row), which raises
//     the row's lower bound; the panels whose largest s + B reaches the final one (a few per row) get their exact
//     chains (gemv_bf16_rows: the bits of quant_linear_bf16 at every M), and the first largest of those is the row's
//     argmax: RowArgmax's index over the same logits.
// Zen 4, one thread, a /tmp loop of the 6-row x 2-panel tile: 181 G multiply-adds per second against the bf16 tiles'
// 115; the whole head at W1's 128 rows 17.7 -> 12.1 ms (benchmarks/README.md).
#if defined(__AVX512VNNI__)
#define PAGEDSERVE_SCREEN_I8 1
constexpr int64_t kI8Tile = 6;     // rows per screen tile
constexpr int64_t kI8Panels = 2;   // panels per screen tile (12 int32 and 12 float accumulators)
constexpr float kI8Floor = 0x1p-60f;
constexpr int64_t kI8Seed = 64;    // panels screened first (see screened_argmax_bf16)

// The screen's norms of a Q8_0 weight (quant_screen_i8_norms): float32, L1_b of panel p's 16 columns at
// (p * nb + b) * 16 (rounded up; zeros past N), then per 16 panels P and block b the largest of each panel's 16 at
// tight + (P * nb + b) * 16 + p % 16.
struct I8Norms {
  const float* tight;
  const float* loose;
};

// A panel's Q8_0 quants as vpdpbusd's signed operands, wq[(b * 8 + j) * 64 + 4 c + i] = q of column c at
// k = 32 b + 4 j + i, its scales as floats, wd[b * 16 + c] = d, and wd[(nb + b) * 16 + c] = 128 d sum_k q (exact:
// d's 11 significant bits times a sum of at most 2^12, times 2^7).
inline void swizzle_q8_vnni(const uint8_t* panel, int64_t nb, uint8_t* wq, float* wd) {
  const __m512i idx = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11,
                                      58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53,
                                      37, 21, 5, 52, 36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32,
                                      16, 0);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + b * kQ8Block;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb)));
    __m512i q = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(pb + 32 + 64 * j));  // planes 4 j .. 4 j + 3
      _mm512_store_si512(wq + (b * 8 + j) * 64, v);
      q = _mm512_dpbusd_epi32(q, ones, v);
    }
    _mm512_store_ps(wd + b * 16, d);
    _mm512_store_ps(wd + (nb + b) * 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_slli_epi32(q, 7))));
  }
}

// s[r * 16 P + 16 p + c] = sum_b fl(fl(I_b d_b) dx_b) for R rows (ux = qx + 128, row stride xs, from block 0; dx:
// row stride nb) against P swizzled panels (wq / wd, panel stride qstride / 2 nb * 16): vpdpbusd gives
// I'_b = sum (qx + 128) q = I_b + 128 sum q, and fmsub(I'_b, d, 128 d sum q) rounds d I_b once.
template <int R, int P>
inline void screen_i8_tile(const uint8_t* ux, int64_t xs, const float* dx, int64_t nb, const uint8_t* wq,
                           int64_t qstride, const float* wd, float* s) {
  __m512 sf[R * P];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) sf[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[R * P];
    PAGEDSERVE_UNROLL
    for (int i = 0; i < R * P; ++i) acc[i] = _mm512_setzero_si512();
    PAGEDSERVE_UNROLL
    for (int j = 0; j < 8; ++j) {
      __m512i w[P];
      PAGEDSERVE_UNROLL
      for (int p = 0; p < P; ++p) w[p] = _mm512_load_si512(wq + p * qstride + (b * 8 + j) * 64);
      PAGEDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t q4;
        std::memcpy(&q4, ux + r * xs + b * 32 + 4 * j, 4);
        const __m512i a = _mm512_set1_epi32(q4);
        PAGEDSERVE_UNROLL
        for (int p = 0; p < P; ++p) acc[r * P + p] = _mm512_dpbusd_epi32(acc[r * P + p], a, w[p]);
      }
    }
    PAGEDSERVE_UNROLL
    for (int p = 0; p < P; ++p) {
      const __m512 d = _mm512_load_ps(wd + p * 2 * nb * 16 + b * 16);
      const __m512 cq = _mm512_load_ps(wd + p * 2 * nb * 16 + (nb + b) * 16);
      PAGEDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(acc[r * P + p]), d, cq);
        sf[r * P + p] = _mm512_fmadd_ps(t, _mm512_set1_ps(dx[r * nb + b]), sf[r * P + p]);
      }
    }
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) _mm512_storeu_ps(s + i * 16, sf[i]);
}

template <int P>
inline void screen_i8_rows(int64_t R, const uint8_t* ux, int64_t xs, const float* dx, int64_t nb, const uint8_t* wq,
                           int64_t qstride, const float* wd, float* s) {
  switch (R) {
    case 1: screen_i8_tile<1, P>(ux, xs, dx, nb, wq, qstride, wd, s); break;
    case 2: screen_i8_tile<2, P>(ux, xs, dx, nb, wq, qstride, wd, s); break;
    case 3: screen_i8_tile<3, P>(ux, xs, dx, nb, wq, qstride, wd, s); break;
    case 4: screen_i8_tile<4, P>(ux, xs, dx, nb, wq, qstride, wd, s); break;
    case 5: screen_i8_tile<5, P>(ux, xs, dx, nb, wq, qstride, wd, s); break;
    default: screen_i8_tile<6, P>(ux, xs, dx, nb, wq, qstride, wd, s); break;
  }
}

// int64 [M]: each row's first argmax of quant_linear_bf16's float32 logits over a Q8_0 weight (no bias) for bf16 x
// (uint16 bits, row stride xs), -1 where one is NaN (only a row that takes every exact logit can have one).
void screened_argmax_bf16(const uint16_t* x, int64_t xs, const uint8_t* w, I8Norms norms, int64_t M, int64_t N,
                          int64_t K, int64_t* out) {
  const int64_t nb = K / 32, panels = (N + 15) / 16, pstride = nb * kQ8Block, qs = K;
  const int64_t pgroups = (panels + 15) / 16;
  // The calling thread's buffers, grown and kept (fresh ones cost their page faults at every call: ~0.4 ms at W1's
  // 128 rows).
  struct Scratch {
    std::vector<uint8_t> q, full;
    std::vector<float> dx, et, loose, upper;
    std::vector<int32_t> pairs;
  };
  static thread_local Scratch sc;
  sc.q.resize(M * qs);
  sc.dx.resize(M * nb);
  sc.loose.resize(M * pgroups * 16);
  const int64_t Mp = (M + 63) / 64 * 64;  // e transposed: [nb][Mp], zeros past M
  sc.et.assign(nb * Mp, 0.f);
  sc.upper.assign(M * panels, -std::numeric_limits<float>::infinity());
  sc.full.assign(M, 0);
  std::vector<uint8_t>& qbuf = sc.q;
  std::vector<float>&dxv = sc.dx, &et = sc.et, &loose = sc.loose, &upper = sc.upper;
  std::vector<uint8_t>& full = sc.full;
  const float c = 1.02f * (0.5001f + 127.0001f * (0x1p-9f + 1.01f * static_cast<float>(K + 2 * nb + 4) * 0x1p-24f));
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    const __m512i mag = _mm512_set1_epi32(0x7fff);
    for (int64_t m = m0; m < m1; ++m) {
      const uint16_t* xr = x + m * xs;
      uint8_t* q = qbuf.data() + m * qs;
      uint32_t top = 0;  // max |x| as float bits (a NaN or infinity above every finite value)
      for (int64_t b = 0; b < nb; ++b) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + b * 32)));
        const __m512i hi =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + b * 32 + 16)));
        const uint32_t bt =
            _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_and_si512(lo, mag), _mm512_and_si512(hi, mag))) << 16;
        top = std::max(top, bt);
        float amax;
        std::memcpy(&amax, &bt, 4);
        float dx = 0.f;
        __m512i q0 = _mm512_setzero_si512(), q1 = q0;
        if (bt < kScreenMaxBits && amax >= 0x1p-100f) {  // (else: no screen for this row, or a block of zeros)
          const __m512 inv = _mm512_set1_ps(127.f / amax);
          dx = amax / 127.f;
          // qx = round(x * inv) (nearest-even), within +-127
          const auto quant = [&](__m512i v) {
            const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), inv));
            return _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
          };
          q0 = quant(lo);
          q1 = quant(hi);
        }
        const __m512i off = _mm512_set1_epi32(128);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtepi32_epi8(_mm512_add_epi32(q0, off)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(q1, off)));
        dxv[m * nb + b] = dx;
        et[b * Mp + m] = std::max(dx, kI8Floor);  // e_b
      }
      full[m] = top < kScreenMinBits || top >= kScreenMaxBits;
    }
  });
  // Bl per row and panel, c * sum_b e_b max L1_b, panel-major (loose[p * M + m]: the screen reads a tile's rows of one
  // panel together), 64 rows at a time from e transposed.
  at::parallel_for(0, panels, 64, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* l1 = norms.loose + ((p / 16) * nb) * 16 + p % 16;  // block b's at l1[b * 16]
      for (int64_t m0 = 0; m0 < M; m0 += 64) {
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t b = 0; b < nb; ++b) {
          const __m512 lb = _mm512_set1_ps(l1[b * 16]);
          PAGEDSERVE_UNROLL
          for (int i = 0; i < 4; ++i)
            a[i] = _mm512_fmadd_ps(lb, _mm512_loadu_ps(et.data() + b * Mp + m0 + 16 * i), a[i]);
        }
        PAGEDSERVE_UNROLL
        for (int i = 0; i < 4; ++i) {
          const int64_t left = M - m0 - 16 * i;
          if (left <= 0) break;
          _mm512_mask_storeu_ps(loose.data() + p * M + m0 + 16 * i, first_lanes(left),
                                _mm512_mul_ps(a[i], _mm512_set1_ps(c)));
        }
      }
    }
  });
  // The screen: threads claim ranges of panel pairs (claim_for); per thread and row the largest s - B so far (lower),
  // and per row and panel the largest s + B of the panel's columns (upper) where the panel's s + Bl reached that
  // lower when it was screened (else -inf: none of its columns can reach the final lower, which only grows). Which
  // thread screens a panel changes neither: the argmax is exact.
  const int64_t threads = at::get_num_threads();
  std::vector<float> lower(threads * M, -std::numeric_limits<float>::infinity());
  const int64_t qstride = nb * 512, dstride = 2 * nb * 16;
  // Panels p0 .. p0 + np - 1 (np <= kI8Panels) for every row on thread t (wq / wd: its swizzle buffers).
  const auto screen = [&](int64_t t, int64_t p0, int64_t np, uint8_t* wq, float* wd) {
    alignas(64) float s[kI8Tile * kI8Panels * 16];
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t p = 0; p < np; ++p) swizzle_q8_vnni(w + (p0 + p) * pstride, nb, wq + p * qstride, wd + p * dstride);
    // The next group's bytes into L2 during this one's row tiles (its swizzle otherwise waits for memory: ~10% of
    // the screen), a share per row tile.
    const uint8_t* next = w + (p0 + np) * pstride;
    const int64_t ahead = std::min(kI8Panels, panels - p0 - np) * pstride, tiles = (M + kI8Tile - 1) / kI8Tile;
    const int64_t share = ((ahead + tiles - 1) / tiles + 63) / 64 * 64;
    for (int64_t r0 = 0; r0 < M; r0 += kI8Tile) {
      const int64_t R = std::min(kI8Tile, M - r0), off = r0 / kI8Tile * share;
      if (off < ahead) prefetch_l2(next + off, std::min(share, ahead - off));
      const uint8_t* ux = qbuf.data() + r0 * qs;
      if (np == kI8Panels)
        screen_i8_rows<kI8Panels>(R, ux, qs, dxv.data() + r0 * nb, nb, wq, qstride, wd, s);
      else
        screen_i8_rows<1>(R, ux, qs, dxv.data() + r0 * nb, nb, wq, qstride, wd, s);
      for (int64_t i = 0; i < R; ++i) {
        const int64_t m = r0 + i, at = t * M + m;
        if (full[m]) continue;
        const float* e = et.data() + m;  // e_b at e[b * Mp]
        for (int64_t p = 0; p < np; ++p) {
          const int64_t n0 = (p0 + p) * 16;
          const __mmask16 live = first_lanes(N - n0);
          const __m512 sv = _mm512_loadu_ps(s + (i * np + p) * 16);
          // Bl first (one add per panel); only a panel where some s + Bl reaches the lower bound gets its B.
          const __m512 ul = _mm512_add_ps(sv, _mm512_set1_ps(loose[(p0 + p) * M + m]));
          if (!_mm512_mask_cmp_ps_mask(live, ul, _mm512_set1_ps(lower[at]), _CMP_GE_OQ)) continue;
          const float* l1 = norms.tight + (p0 + p) * nb * 16;
          __m512 b4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          int64_t b = 0;
          for (; b + 4 <= nb; b += 4) {
            PAGEDSERVE_UNROLL
            for (int h = 0; h < 4; ++h)
              b4[h] = _mm512_fmadd_ps(_mm512_set1_ps(e[(b + h) * Mp]), _mm512_loadu_ps(l1 + (b + h) * 16), b4[h]);
          }
          for (; b < nb; ++b) b4[0] = _mm512_fmadd_ps(_mm512_set1_ps(e[b * Mp]), _mm512_loadu_ps(l1 + b * 16), b4[0]);
          const __m512 bt =
              _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(b4[0], b4[1]), _mm512_add_ps(b4[2], b4[3])), _mm512_set1_ps(c));
          lower[at] = std::max(lower[at], _mm512_reduce_max_ps(_mm512_mask_sub_ps(ninf, live, sv, bt)));
          upper[m * panels + p0 + p] = _mm512_mask_reduce_max_ps(live, _mm512_add_ps(sv, bt));
        }
      }
    }
  };
  // First the seed, the first kI8Seed panels (tokenizers number their most frequent tokens first, and a greedy row's
  // maximum is mostly among them or near their best), then the rest with every thread's lowers at the seed's best:
  // with each thread's lowers at -inf at the start of its range, a third of all row-panels needed their B (SmolLM2,
  // W1's rows; a sample of every 16th panel as the seed: a quarter), with the seed 1.6%.
  const int64_t seed_pairs = std::min(kI8Seed, panels) / kI8Panels, pairs = (panels + kI8Panels - 1) / kI8Panels;
  const auto run = [&](int64_t g0, int64_t g1) {
    claim_for(g1 - g0, [&](int64_t a, int64_t b) {
      std::vector<uint8_t> qv;
      std::vector<float> dv;
      uint8_t* wq = align64(qv, kI8Panels * qstride);
      float* wd = align64(dv, kI8Panels * dstride);
      for (int64_t g = g0 + a; g < g0 + b; ++g)
        screen(at::get_thread_num(), g * kI8Panels, std::min(kI8Panels, panels - g * kI8Panels), wq, wd);
    });
  };
  run(0, seed_pairs);
  for (int64_t m = 0; m < M; ++m) {
    float seed = lower[m];
    for (int64_t t = 1; t < threads; ++t) seed = std::max(seed, lower[t * M + m]);
    for (int64_t t = 0; t < threads; ++t) lower[t * M + m] = seed;
  }
  run(seed_pairs, pairs);
  // The candidates: per row the panels whose upper reaches the row's final lower (every panel for a full row), as
  // (panel, row) pairs in panel order; their exact chains a panel at a time, up to 4 of its rows together
  // (gemv_bf16_rows: the chains of quant_linear_bf16 at every M); then per row the first largest in column order.
  std::vector<float> lo(M, -std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < threads; ++t)
    for (int64_t m = 0; m < M; ++m) lo[m] = std::max(lo[m], lower[t * M + m]);
  std::vector<int32_t>& pr = sc.pairs;  // panel * M + row
  pr.clear();
  for (int64_t m = 0; m < M; ++m) {
    const float* u = upper.data() + m * panels;
    const __m512 lv = _mm512_set1_ps(full[m] ? -std::numeric_limits<float>::infinity() : lo[m]);
    for (int64_t p0 = 0; p0 < panels; p0 += 16) {
      const __mmask16 in = first_lanes(panels - p0);
      uint32_t bits = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, u + p0), lv, _CMP_GE_OQ);
      if (full[m]) bits = in;
      for (; bits; bits &= bits - 1) pr.push_back(static_cast<int32_t>((p0 + __builtin_ctz(bits)) * M + m));
    }
  }
  std::sort(pr.begin(), pr.end());
  const int64_t np = static_cast<int64_t>(pr.size());
  std::vector<float> logits(np * 16);
  // Runs of up to 4 pairs of one panel.
  std::vector<int64_t> runs;
  for (int64_t i = 0; i < np;) {
    runs.push_back(i);
    int64_t j = i + 1;
    while (j < np && j - i < 4 && pr[j] / M == pr[i] / M) ++j;
    i = j;
  }
  runs.push_back(np);
  at::parallel_for(0, static_cast<int64_t>(runs.size()) - 1, 4, [&](int64_t r0, int64_t r1) {
    alignas(64) float acc[4 * 16];
    std::vector<uint16_t> xb(4 * K);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i0 = runs[r], n = runs[r + 1] - i0, p = pr[i0] / M;
      for (int64_t i = 0; i < n; ++i) std::memcpy(xb.data() + i * K, x + (pr[i0 + i] % M) * xs, K * 2);
      gemv_bf16_rows<kQ8_0, 1>(n, xb.data(), K, w + p * pstride, pstride, K, acc);
      std::memcpy(logits.data() + i0 * 16, acc, n * 16 * 4);
    }
  });
  std::fill(out, out + M, int64_t{0});
  std::vector<float> best(M, -std::numeric_limits<float>::infinity());
  std::vector<uint8_t> nan(M, 0);
  for (int64_t i = 0; i < np; ++i) {  // panels ascending: each row's columns in order
    const int64_t p = pr[i] / M, m = pr[i] % M;
    for (int64_t j = 0; j < std::min<int64_t>(16, N - p * 16); ++j) {
      const float v = logits[i * 16 + j];
      nan[m] = nan[m] || nan_bits(v);
      if (v > best[m]) {
        best[m] = v;
        out[m] = p * 16 + j;
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    if (nan[m]) out[m] = -1;
}
#endif

#endif

// ---- int8 activations (AVX512-VNNI + VBMI, or AVX2: the same bits): quant_linear_i8 -------------------------------
//
// llama.cpp's (and vLLM's GGUF kernels') numerics for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K: each row of x
// is quantized to int8 per 32-k block (dx = max |x| / 127, q = x / dx rounded to nearest-even; an all-zero block has
// dx = 0), and the result is the dequantized float32 weights times that quantized x: y = W . Q(x), Q(x) = dx * q.
// The weights' quants meet the activations' in integer dot products (vpdpbusd: 4 unsigned bytes times 4 signed bytes
// per int32 lane; one lane per output row of a panel; on AVX2 vpmaddubsw / vpmaddwd, see there), exact, so per 32-k
// block and output:
//   Q4_1: d dx (qw . qx) + m dx (sum qx)      Q4_0: d dx (qw . qx - 8 sum qx)      Q8_0: d dx ((qw + 128) . qx - 128 sum qx)
//   Q5_1, Q5_0: as Q4_1, Q4_0 with 5-bit qw and 16 for 8      Q4_K, Q5_K, Q6_K: per sub-block, see their kernels
// (Q8_0's signed quants are biased to unsigned by flipping their top bit, the bias taken out again exactly). Every
// output is one float32 chain over the blocks in order, whatever M or the thread count: a row's result does not
// depend on the batch. It is NOT the reference's result: Q(x) differs from x by up to dx / 2 per element (a
// relative 0.4% of the block's largest), about what rounding x to bf16 does to each element -- so logits move a
// little and greedy tokens may differ from the bf16 route's. Few rows only (decode, bound by reading and widening
// the weights): prefill-sized matmuls keep the model's route (model/matmul.py decides).
#if defined(PAGEDSERVE_QUANT_AVX2)
#define PAGEDSERVE_QUANT_I8 1
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define PAGEDSERVE_QUANT_I8_VNNI 1  // else the AVX2 kernels below (the same types, the same bits)
#endif

// x quantized per 32-k block, row after row: q [M][K] int8, dx [M][nb], sq [M][nb] (sum of the block's q), sq16
// [M][2 nb] (the sums of each block's two 16-k halves: Q6_K's sub-blocks); the AVX2 kernels also take q as int16,
// q16 [M][K] (null for the VNNI ones).
struct XQ {
  const int8_t* q;
  const float* dx;
  const int32_t* sq;
  const int32_t* sq16;
  const int16_t* q16;
  int64_t K, nb;
};

#ifdef PAGEDSERVE_QUANT_I8_VNNI

// vpermb index gathering 4 byte planes of a packed block (64 bytes: plane j's 16 rows at 16 j) into one int32 lane per
// row: byte 4 r + j <- byte 16 j + r.
struct PlaneIdx {
  alignas(64) uint8_t v[64];
  constexpr PlaneIdx() : v() {
    for (int r = 0; r < 16; ++r)
      for (int j = 0; j < 4; ++j) v[4 * r + j] = static_cast<uint8_t>(16 * j + r);
  }
};
inline constexpr PlaneIdx kPlaneIdx{};

// Q5_0 / Q5_1: vpmultishiftqb controls putting the fifth bit of k = 4 i + j (low nibbles; + 16: high nibbles) at bit 4
// of byte j of each row's lane. The block's qh gathered by kPlaneIdx holds row r's 32 bits in lane r, two rows per
// qword; a control byte selects 8 bits of its qword from that offset (mod 64), so offset k - 4 (+ 32 for odd rows)
// puts bit k at bit 4 (the other 7 bits are masked off).
struct Q5Ctrl {
  alignas(64) uint8_t v[8][64];  // [2 i + half]
  constexpr Q5Ctrl() : v() {
    for (int i = 0; i < 4; ++i)
      for (int half = 0; half < 2; ++half)
        for (int r = 0; r < 16; ++r)
          for (int j = 0; j < 4; ++j)
            v[2 * i + half][4 * r + j] = static_cast<uint8_t>((32 * (r & 1) + 16 * half + 4 * i + j - 4) & 63);
  }
};
inline constexpr Q5Ctrl kQ5Ctrl{};

template <int64_t T, int R, int P>
void gemv_i8_panels(const XQ& xq, const uint8_t* panel, int64_t pstride, float* acc) {
  constexpr int64_t pbb = 16 * quant_type(T).block_bytes;  // a packed block: 32 k of 16 rows
  constexpr int64_t qoff = T == kQ4_1 ? 64 : (T == kQ5_0 ? 96 : (T == kQ5_1 ? 128 : 32));
  constexpr bool five = T == kQ5_0 || T == kQ5_1;
  [[maybe_unused]] constexpr int64_t qhoff = T == kQ5_0 ? 32 : 64;
  [[maybe_unused]] const __m512i bit4 = _mm512_set1_epi8(0x10);
  const __m512i idx = _mm512_load_si512(kPlaneIdx.v);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 c[R * P];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) c[i] = _mm512_setzero_ps();
  const int64_t nb = xq.nb;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_stream(panel, b * P * pbb, P * pbb);
    PAGEDSERVE_UNROLL
    for (int p = 0; p < P; ++p) {
      const uint8_t* pb = panel + p * pstride + b * pbb;
      const uint8_t* q = pb + qoff;
      __m512i s0[R], s1[R];
      PAGEDSERVE_UNROLL
      for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
      if constexpr (T == kQ8_0) {
        const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
        PAGEDSERVE_UNROLL
        for (int i = 0; i < 8; i += 2) {  // planes 4 i .. 4 i + 7: k = 4 i .. 4 i + 7
          const __m512i u0 = _mm512_xor_si512(_mm512_permutexvar_epi8(idx, _mm512_loadu_si512(q + 64 * i)), flip);
          const __m512i u1 = _mm512_xor_si512(_mm512_permutexvar_epi8(idx, _mm512_loadu_si512(q + 64 * i + 64)), flip);
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r) {
            int32_t a0, a1;
            std::memcpy(&a0, xq.q + r * xq.K + b * 32 + 4 * i, 4);
            std::memcpy(&a1, xq.q + r * xq.K + b * 32 + 4 * i + 4, 4);
            s0[r] = _mm512_dpbusd_epi32(s0[r], u0, _mm512_set1_epi32(a0));
            s1[r] = _mm512_dpbusd_epi32(s1[r], u1, _mm512_set1_epi32(a1));
          }
        }
      } else {
        [[maybe_unused]] __m512i qh;
        if constexpr (five) qh = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(pb + qhoff));  // lane r: row r's bits
        PAGEDSERVE_UNROLL
        for (int i = 0; i < 4; ++i) {  // planes 4 i .. 4 i + 3: low nibbles k = 4 i .., high nibbles k = 16 + 4 i ..
          const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(q + 64 * i));
          __m512i lo = _mm512_and_si512(v, low4);
          __m512i hi;
          if constexpr (five) {  // q = nibble + 16 * fifth bit: 0 .. 31
            const __m512i h0 = _mm512_multishift_epi64_epi8(_mm512_load_si512(kQ5Ctrl.v[2 * i]), qh);
            const __m512i h1 = _mm512_multishift_epi64_epi8(_mm512_load_si512(kQ5Ctrl.v[2 * i + 1]), qh);
            lo = _mm512_or_si512(lo, _mm512_and_si512(h0, bit4));
            hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_and_si512(h1, bit4));
          } else {
            hi = _mm512_andnot_si512(low4, v);  // 16 q: the sums come out 16 times, exactly
          }
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r) {
            int32_t a0, a1;
            std::memcpy(&a0, xq.q + r * xq.K + b * 32 + 4 * i, 4);
            std::memcpy(&a1, xq.q + r * xq.K + b * 32 + 16 + 4 * i, 4);
            s0[r] = _mm512_dpbusd_epi32(s0[r], lo, _mm512_set1_epi32(a0));
            s1[r] = _mm512_dpbusd_epi32(s1[r], hi, _mm512_set1_epi32(a1));
          }
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb)));
      [[maybe_unused]] __m512 m;
      if constexpr (T == kQ4_1 || T == kQ5_1)
        m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 32)));
      PAGEDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        const float dx = xq.dx[r * nb + b];
        const int32_t sq = xq.sq[r * nb + b];
        __m512i s = T == kQ8_0 || five ? _mm512_add_epi32(s0[r], s1[r])
                                       : _mm512_add_epi32(s0[r], _mm512_srai_epi32(s1[r], 4));
        if constexpr (T == kQ4_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * sq));
        if constexpr (T == kQ5_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(16 * sq));
        if constexpr (T == kQ8_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * sq));
        __m512& cc = c[r * P + p];
        // pinned (common.h): the same grouping of d dx whatever the row count (see gemv_i8_q4k_panels)
        cc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), pinned(_mm512_mul_ps(d, _mm512_set1_ps(dx))), cc);
        if constexpr (T == kQ4_1 || T == kQ5_1)
          cc = _mm512_fmadd_ps(m, pinned(_mm512_set1_ps(dx * static_cast<float>(sq))), cc);
      }
    }
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) _mm512_storeu_ps(acc + (i / P) * P * 16 + (i % P) * 16, c[i]);
}

// Q4_K / Q5_K: a 256-k block of 8 sub-blocks of 32 k, each with a 6-bit scale sc and min mn (weight d sc q - dmin mn);
// the sub-blocks 2 t and 2 t + 1 share 32 byte planes (low nibbles: 2 t, high: 2 t + 1). Q5_K's fifth bit of k = 32 s
// + l is bit s of its qh plane l (gathered as the quants are, then rotated to bit 4 of each byte and masked). Per
// sub-block and output: d sc dx (qw . qx) - dmin mn dx (sum qx), in the same steps as gemv_i8_panels.
template <int64_t T, int R, int P>
void gemv_i8_q4k_panels(const XQ& xq, const uint8_t* panel, int64_t pstride, float* acc) {
  static_assert(T == kQ4_K || T == kQ5_K);
  constexpr bool five = T == kQ5_K;
  constexpr int64_t pbb = 16 * quant_type(T).block_bytes;  // a packed block: 256 k of 16 rows
  constexpr int64_t qs_off = five ? 768 : 256, qh_off = 256;
  const __m512i idx = _mm512_load_si512(kPlaneIdx.v);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  [[maybe_unused]] const __m512i bit4 = _mm512_set1_epi8(0x10);
  __m512 c[R * P];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) c[i] = _mm512_setzero_ps();
  const int64_t nb = xq.nb;
  for (int64_t sb = 0; sb < xq.K / 256; ++sb) {
    for (int t = 0; t < 4; ++t) {  // the sub-block pair (2 t, 2 t + 1): 64 k
      prefetch_stream(panel, (sb * 4 + t) * P * (pbb / 4), P * (pbb / 4));
      PAGEDSERVE_UNROLL
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = panel + p * pstride + sb * pbb;
        const uint8_t* q = pb + qs_off + t * 32 * 16;
        const int64_t b0 = sb * 8 + 2 * t;  // x's 32-k block of sub-block 2 t
        // Q5_K: rotating each 32-bit lane left by 4 - 2 t (3 - 2 t) brings bit 2 t (2 t + 1) of every byte to its bit 4.
        [[maybe_unused]] const __m512i rot_lo = _mm512_set1_epi32((4 - 2 * t) & 31),
                                       rot_hi = _mm512_set1_epi32((3 - 2 * t) & 31);
        __m512i s0[R], s1[R];
        PAGEDSERVE_UNROLL
        for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
        PAGEDSERVE_UNROLL
        for (int i = 0; i < 8; ++i) {  // planes 4 i .. 4 i + 3: k = 4 i .. 4 i + 3 of both sub-blocks
          const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(q + 64 * i));
          __m512i lo = _mm512_and_si512(v, low4);
          __m512i hi;
          if constexpr (five) {  // q = nibble + 16 * (bit 2 t or 2 t + 1 of qh plane 4 i + j): 0 .. 31
            const __m512i h = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(pb + qh_off + 64 * i));
            lo = _mm512_ternarylogic_epi32(lo, _mm512_rolv_epi32(h, rot_lo), bit4, 0xF8);  // lo | (rot & bit4)
            hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_rolv_epi32(h, rot_hi),
                                           bit4, 0xF8);
          } else {
            hi = _mm512_andnot_si512(low4, v);  // 16 q, as in gemv_i8_panels
          }
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r) {
            int32_t a0, a1;
            std::memcpy(&a0, xq.q + r * xq.K + b0 * 32 + 4 * i, 4);
            std::memcpy(&a1, xq.q + r * xq.K + (b0 + 1) * 32 + 4 * i, 4);
            s0[r] = _mm512_dpbusd_epi32(s0[r], lo, _mm512_set1_epi32(a0));
            s1[r] = _mm512_dpbusd_epi32(s1[r], hi, _mm512_set1_epi32(a1));
          }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 32)));
        PAGEDSERVE_UNROLL
        for (int h = 0; h < 2; ++h) {
          __m128i sc, mn;
          k_scale_min16(pb + 64, 2 * t + h, sc, mn);
          // Each factor pinned (common.h): -ffast-math may otherwise regroup d sc dx per row count differently,
          // and a row's bits would depend on the batch.
          const __m512 scale = pinned(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc))));
          const __m512 mins = pinned(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn))));
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r) {
            const float dx = xq.dx[r * nb + b0 + h];
            const int32_t sq = xq.sq[r * nb + b0 + h];
            const __m512i s = h ? (five ? s1[r] : _mm512_srai_epi32(s1[r], 4)) : s0[r];
            __m512& cc = c[r * P + p];
            cc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), pinned(_mm512_mul_ps(scale, _mm512_set1_ps(dx))), cc);
            cc = _mm512_fnmadd_ps(mins, pinned(_mm512_set1_ps(dx * static_cast<float>(sq))), cc);
          }
        }
      }
    }
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) _mm512_storeu_ps(acc + (i / P) * P * 16 + (i % P) * 16, c[i]);
}

// Q6_K: a 256-k block of 16 sub-blocks of 16 k, each with an int8 scale sc (weight d sc (q - 32), q 6 bits: a nibble
// of ql and two bits of qh). In each 128-k half h, the 4 byte planes of ql at 64 h + 4 i (low nibbles: x block 4 h,
// high: 4 h + 2) and at 64 h + 32 + 4 i (4 h + 1, 4 h + 3) and those of qh at 32 h + 4 i (bits 2 g, 2 g + 1 for x block
// 4 h + g) give k = 4 i .. 4 i + 3 of four 32-k blocks. Per 16-k sub-block and output, exactly in int32:
// sc (qw . qx - 32 sum qx) (|.| < 2^23), then one FMA with d dx.
template <int R, int P>
void gemv_i8_q6k_panels(const XQ& xq, const uint8_t* panel, int64_t pstride, float* acc) {
  constexpr int64_t pbb = 16 * quant_type(kQ6_K).block_bytes;  // a packed block: 256 k of 16 rows
  constexpr int64_t sc_off = 32, ql_off = 288, qh_off = 2336;
  const __m512i idx = _mm512_load_si512(kPlaneIdx.v);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i two = _mm512_set1_epi8(0x30);
  __m512 c[R * P];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) c[i] = _mm512_setzero_ps();
  const int64_t nb = xq.nb;
  for (int64_t sb = 0; sb < xq.K / 256; ++sb) {
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 2; ++s) {  // the 16-k sub-blocks: k = 16 s .. 16 s + 15 of each 32-k block
        prefetch_stream(panel, (sb * 4 + h * 2 + s) * P * (pbb / 4), P * (pbb / 4));
        PAGEDSERVE_UNROLL
        for (int p = 0; p < P; ++p) {
          const uint8_t* pb = panel + p * pstride + sb * pbb;
          const int64_t b0 = sb * 8 + 4 * h;  // x's 32-k block of g = 0
          __m512i a[R][4];
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r)
            for (int g = 0; g < 4; ++g) a[r][g] = _mm512_setzero_si512();
          PAGEDSERVE_UNROLL
          for (int i = 4 * s; i < 4 * s + 4; ++i) {
            const __m512i la = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(pb + ql_off + 16 * (64 * h + 4 * i)));
            const __m512i lb =
                _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(pb + ql_off + 16 * (64 * h + 32 + 4 * i)));
            const __m512i hb = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(pb + qh_off + 16 * (32 * h + 4 * i)));
            // q = nibble | (two qh bits) << 4 (16-bit shifts: the bits a shift moves across bytes are masked off)
            __m512i qv[4];
            qv[0] = _mm512_or_si512(_mm512_and_si512(la, low4), _mm512_and_si512(_mm512_slli_epi16(hb, 4), two));
            qv[1] = _mm512_or_si512(_mm512_and_si512(lb, low4), _mm512_and_si512(_mm512_slli_epi16(hb, 2), two));
            qv[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(la, 4), low4), _mm512_and_si512(hb, two));
            qv[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lb, 4), low4),
                                    _mm512_and_si512(_mm512_srli_epi16(hb, 2), two));
            PAGEDSERVE_UNROLL
            for (int r = 0; r < R; ++r) {
              PAGEDSERVE_UNROLL
              for (int g = 0; g < 4; ++g) {
                int32_t x4;
                std::memcpy(&x4, xq.q + r * xq.K + (b0 + g) * 32 + 4 * i, 4);
                a[r][g] = _mm512_dpbusd_epi32(a[r][g], qv[g], _mm512_set1_epi32(x4));
              }
            }
          }
          const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb)));
          PAGEDSERVE_UNROLL
          for (int g = 0; g < 4; ++g) {
            const __m512i sc = _mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(pb + sc_off + 16 * (8 * h + 2 * g + s))));
            PAGEDSERVE_UNROLL
            for (int r = 0; r < R; ++r) {
              const int64_t b = b0 + g;
              const __m512i t = _mm512_mullo_epi32(
                  _mm512_sub_epi32(a[r][g], _mm512_set1_epi32(32 * xq.sq16[r * 2 * nb + 2 * b + s])), sc);
              __m512& cc = c[r * P + p];
              // pinned (common.h), as in gemv_i8_panels
              cc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), pinned(_mm512_mul_ps(d, _mm512_set1_ps(xq.dx[r * nb + b]))),
                                   cc);
            }
          }
        }
      }
    }
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) _mm512_storeu_ps(acc + (i / P) * P * 16 + (i % P) * 16, c[i]);
}

template <int64_t T, int P>
inline void gemv_i8_rows(int64_t R, const XQ& xq, const uint8_t* panel, int64_t pstride, float* acc) {
  if constexpr (T == kQ6_K) {
    switch (R) {
      case 1: gemv_i8_q6k_panels<1, P>(xq, panel, pstride, acc); break;
      case 2: gemv_i8_q6k_panels<2, P>(xq, panel, pstride, acc); break;
      case 3: gemv_i8_q6k_panels<3, P>(xq, panel, pstride, acc); break;
      default: gemv_i8_q6k_panels<4, P>(xq, panel, pstride, acc); break;
    }
    return;
  }
  if constexpr (T == kQ4_K || T == kQ5_K) {
    switch (R) {
      case 1: gemv_i8_q4k_panels<T, 1, P>(xq, panel, pstride, acc); break;
      case 2: gemv_i8_q4k_panels<T, 2, P>(xq, panel, pstride, acc); break;
      case 3: gemv_i8_q4k_panels<T, 3, P>(xq, panel, pstride, acc); break;
      default: gemv_i8_q4k_panels<T, 4, P>(xq, panel, pstride, acc); break;
    }
    return;
  }
  switch (R) {
    case 1: gemv_i8_panels<T, 1, P>(xq, panel, pstride, acc); break;
    case 2: gemv_i8_panels<T, 2, P>(xq, panel, pstride, acc); break;
    case 3: gemv_i8_panels<T, 3, P>(xq, panel, pstride, acc); break;
    default: gemv_i8_panels<T, 4, P>(xq, panel, pstride, acc); break;
  }
}

#else  // PAGEDSERVE_QUANT_I8_VNNI
// ---- the same definition on AVX2 (+ FMA, F16C): CPUs without AVX512-VNNI + VBMI ------------------------------
// The integer sums of each 32-k block and output are the VNNI kernels' (exact either way) and the float steps per
// lane are theirs (one FMA with the pinned d dx, Q4_1 / Q5_1 one with m and dx sum qx), so an AVX2 build gives the
// same bits. 4- and 5-bit quants: a plane pair (planes j, j + 1: 16 rows' bytes of k = j, j + 1 and of 16 + j,
// 17 + j) interleaved row by row (pair_rows), so that vpmaddubsw multiplies a row's two quants (unsigned) by the two
// activations (signed) and adds the pair into that row's int16 lane; a few steps are summed in int16 (|sum| < 2^15 by
// the bounds at kSteps16) before they are widened to int32. Q8_0's signed quants are widened to int16 and meet the
// activations' int16 pairs in vpmaddwd (int32 straight away).

// Planes j, j + 1 (32 bytes: 16 rows each) -> row r's two bytes at 2 r of lane r / 8 (rows 0-7 in lane 0).
inline __m256i pair_rows(const uint8_t* planes) {
  const __m256i v = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(planes)), 0xD8);
  const __m256i idx = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10, 3, 11,
                                       4, 12, 5, 13, 6, 14, 7, 15);
  return _mm256_shuffle_epi8(v, idx);
}

// int16 lanes (rows 0-7 | 8-15) added into two int32 vectors of rows 0-7 and 8-15.
inline void widen_add(__m256i v, __m256i& s0, __m256i& s1) {
  s0 = _mm256_add_epi32(s0, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)));
  s1 = _mm256_add_epi32(s1, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)));
}

// The R x P panels' sums (rows 0-7, 8-15 of each) into acc as the VNNI kernels lay them out: row r, panel p at
// r * 16 P + 16 p.
template <int R, int P>
inline void store_sums(const __m256 (*c)[2], float* acc) {
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) {
    _mm256_storeu_ps(acc + (i / P) * P * 16 + (i % P) * 16, c[i][0]);
    _mm256_storeu_ps(acc + (i / P) * P * 16 + (i % P) * 16 + 8, c[i][1]);
  }
}

inline __m256i bcast16(const int8_t* p) {  // two int8 activations as every int16 lane's byte pair
  int16_t v;
  std::memcpy(&v, p, 2);
  return _mm256_set1_epi16(v);
}

template <int64_t T, int R, int P>
void gemv_i8_panels(const XQ& xq, const uint8_t* panel, int64_t pstride, float* acc) {
  static_assert(T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1 || T == kQ8_0);
  constexpr int64_t pbb = 16 * quant_type(T).block_bytes;  // a packed block: 32 k of 16 rows
  constexpr int64_t qoff = T == kQ4_1 ? 64 : (T == kQ5_0 ? 96 : (T == kQ5_1 ? 128 : 32));
  constexpr bool five = T == kQ5_0 || T == kQ5_1;
  [[maybe_unused]] constexpr int64_t qhoff = T == kQ5_0 ? 32 : 64;
  // Plane pairs summed in int16 before widening: a pair step adds two vpmaddubsw of at most 2 * 15 * 127 (4-bit q)
  // or 2 * 31 * 127 (5-bit) each: 4 steps <= 30,480, 2 steps <= 31,496.
  constexpr int kSteps16 = five ? 2 : 4;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 c[R * P][2];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
  const int64_t nb = xq.nb;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_stream(panel, b * P * pbb, P * pbb);
    PAGEDSERVE_UNROLL
    for (int p = 0; p < P; ++p) {
      const uint8_t* pb = panel + p * pstride + b * pbb;
      const uint8_t* q = pb + qoff;
      __m256i s0[R], s1[R];  // int32 sums, rows 0-7 and 8-15
      PAGEDSERVE_UNROLL
      for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
      if constexpr (T == kQ8_0) {
        PAGEDSERVE_UNROLL
        for (int j = 0; j < 32; j += 2) {
          const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j)));
          const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j + 16)));
          const __m256i lo = _mm256_unpacklo_epi16(w0, w1);  // rows 0-3 | 8-11: (k j, k j + 1)
          const __m256i hi = _mm256_unpackhi_epi16(w0, w1);  // rows 4-7 | 12-15
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r) {
            int32_t a;
            std::memcpy(&a, xq.q16 + r * xq.K + b * 32 + j, 4);
            const __m256i av = _mm256_set1_epi32(a);
            s0[r] = _mm256_add_epi32(s0[r], _mm256_madd_epi16(lo, av));
            s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(hi, av));
          }
        }
        PAGEDSERVE_UNROLL
        for (int r = 0; r < R; ++r) {  // rows (0-3 | 8-11), (4-7 | 12-15) -> 0-7, 8-15
          const __m256i t0 = _mm256_permute2x128_si256(s0[r], s1[r], 0x20);
          s1[r] = _mm256_permute2x128_si256(s0[r], s1[r], 0x31);
          s0[r] = t0;
        }
      } else {
        [[maybe_unused]] __m256i hx[4];  // qh byte plane i, each row's byte twice (2 r, 2 r + 1)
        if constexpr (five) {
          const __m256i dup = _mm256_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11,
                                               11, 12, 12, 13, 13, 14, 14, 15, 15);
          PAGEDSERVE_UNROLL
          for (int i = 0; i < 4; ++i)
            hx[i] = _mm256_shuffle_epi8(
                _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb + qhoff + 16 * i))),
                dup);
        }
        PAGEDSERVE_UNROLL
        for (int j0 = 0; j0 < 16; j0 += 2 * kSteps16) {
          __m256i s16[R];
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
          PAGEDSERVE_UNROLL
          for (int j = j0; j < j0 + 2 * kSteps16; j += 2) {
            const __m256i v = pair_rows(q + 16 * j);
            __m256i lo = _mm256_and_si256(v, low4);                         // k = j, j + 1
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);  // k = 16 + j, 17 + j
            if constexpr (five) {  // the fifth bit of k: bit k % 8 of qh byte k / 8, placed at bit 4
              const int bit = j % 8;
              const __m256i m = _mm256_set1_epi16(static_cast<int16_t>((1 << bit) | ((2 << bit) << 8)));
              const __m256i b4 = _mm256_set1_epi8(0x10);
              lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hx[j / 8], m), m), b4));
              hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hx[2 + j / 8], m), m), b4));
            }
            PAGEDSERVE_UNROLL
            for (int r = 0; r < R; ++r) {
              const int8_t* xr = xq.q + r * xq.K + b * 32;
              s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast16(xr + j)),
                                                                 _mm256_maddubs_epi16(hi, bcast16(xr + 16 + j))));
            }
          }
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r) widen_add(s16[r], s0[r], s1[r]);
        }
      }
      __m256 d0, d1;
      halves(pb, d0, d1);
      [[maybe_unused]] __m256 m0, m1;
      if constexpr (T == kQ4_1 || T == kQ5_1) halves(pb + 32, m0, m1);
      PAGEDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        const float dx = xq.dx[r * nb + b];
        const int32_t sq = xq.sq[r * nb + b];
        if constexpr (T == kQ4_0 || T == kQ5_0) {
          const __m256i off = _mm256_set1_epi32((T == kQ4_0 ? 8 : 16) * sq);
          s0[r] = _mm256_sub_epi32(s0[r], off);
          s1[r] = _mm256_sub_epi32(s1[r], off);
        }
        __m256* cc = c[r * P + p];
        const __m256 dxv = _mm256_set1_ps(dx);
        cc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[r]), pinned(_mm256_mul_ps(d0, dxv)), cc[0]);
        cc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[r]), pinned(_mm256_mul_ps(d1, dxv)), cc[1]);
        if constexpr (T == kQ4_1 || T == kQ5_1) {
          const __m256 ms = pinned(_mm256_set1_ps(dx * static_cast<float>(sq)));
          cc[0] = _mm256_fmadd_ps(m0, ms, cc[0]);
          cc[1] = _mm256_fmadd_ps(m1, ms, cc[1]);
        }
      }
    }
  }
  store_sums<R, P>(c, acc);
}

// Q4_K / Q5_K (see the VNNI kernel): per sub-block pair (2 t, 2 t + 1) 32 byte planes, plane i holding k = i of
// sub-block 2 t (low nibbles) and of 2 t + 1 (high); Q5_K's fifth bits from the qh planes interleaved the same way.
template <int64_t T, int R, int P>
void gemv_i8_q4k_panels(const XQ& xq, const uint8_t* panel, int64_t pstride, float* acc) {
  static_assert(T == kQ4_K || T == kQ5_K);
  constexpr bool five = T == kQ5_K;
  constexpr int64_t pbb = 16 * quant_type(T).block_bytes;  // a packed block: 256 k of 16 rows
  constexpr int64_t qs_off = five ? 768 : 256, qh_off = 256;
  constexpr int kSteps16 = five ? 4 : 8;  // one vpmaddubsw per step: 8 * 3,810 or 4 * 7,874 < 2^15
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(0x01);
  __m256 c[R * P][2];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
  const int64_t nb = xq.nb;
  for (int64_t sb = 0; sb < xq.K / 256; ++sb) {
    for (int t = 0; t < 4; ++t) {
      prefetch_stream(panel, (sb * 4 + t) * P * (pbb / 4), P * (pbb / 4));
      PAGEDSERVE_UNROLL
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = panel + p * pstride + sb * pbb;
        const uint8_t* q = pb + qs_off + t * 32 * 16;
        const int64_t b0 = sb * 8 + 2 * t;
        __m256i s[R][2][2];  // [row][sub-block 2 t + h][rows 0-7, 8-15]
        PAGEDSERVE_UNROLL
        for (int r = 0; r < R; ++r) s[r][0][0] = s[r][0][1] = s[r][1][0] = s[r][1][1] = _mm256_setzero_si256();
        PAGEDSERVE_UNROLL
        for (int i0 = 0; i0 < 32; i0 += 2 * kSteps16) {
          __m256i lo16[R], hi16[R];
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r) lo16[r] = hi16[r] = _mm256_setzero_si256();
          PAGEDSERVE_UNROLL
          for (int i = i0; i < i0 + 2 * kSteps16; i += 2) {
            const __m256i v = pair_rows(q + 16 * i);
            __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if constexpr (five) {  // bit 2 t (2 t + 1) of qh planes i, i + 1 at bit 4
              const __m256i h = pair_rows(pb + qh_off + 16 * i);
              lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * t), one), 4));
              hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * t + 1), one), 4));
            }
            PAGEDSERVE_UNROLL
            for (int r = 0; r < R; ++r) {
              const int8_t* xr = xq.q + r * xq.K + b0 * 32;
              lo16[r] = _mm256_add_epi16(lo16[r], _mm256_maddubs_epi16(lo, bcast16(xr + i)));
              hi16[r] = _mm256_add_epi16(hi16[r], _mm256_maddubs_epi16(hi, bcast16(xr + 32 + i)));
            }
          }
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r) {
            widen_add(lo16[r], s[r][0][0], s[r][0][1]);
            widen_add(hi16[r], s[r][1][0], s[r][1][1]);
          }
        }
        __m256 d0, d1, n0, n1;
        halves(pb, d0, d1);
        halves(pb + 32, n0, n1);
        PAGEDSERVE_UNROLL
        for (int h = 0; h < 2; ++h) {
          __m128i sc, mn;
          k_scale_min16(pb + 64, 2 * t + h, sc, mn);
          const __m256 scale[2] = {pinned(_mm256_mul_ps(d0, u8lo(sc))), pinned(_mm256_mul_ps(d1, u8hi(sc)))};
          const __m256 mins[2] = {pinned(_mm256_mul_ps(n0, u8lo(mn))), pinned(_mm256_mul_ps(n1, u8hi(mn)))};
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r) {
            const float dx = xq.dx[r * nb + b0 + h];
            const __m256 dxv = _mm256_set1_ps(dx);
            const __m256 ms = pinned(_mm256_set1_ps(dx * static_cast<float>(xq.sq[r * nb + b0 + h])));
            PAGEDSERVE_UNROLL
            for (int e = 0; e < 2; ++e) {
              __m256& cc = c[r * P + p][e];
              cc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h][e]), pinned(_mm256_mul_ps(scale[e], dxv)), cc);
              cc = _mm256_fnmadd_ps(mins[e], ms, cc);
            }
          }
        }
      }
    }
  }
  store_sums<R, P>(c, acc);
}

// Q6_K (see the VNNI kernel): per 128-k half h and 16-k sub-block s, plane pairs (kk, kk + 1) of ql at 64 h + kk and
// 64 h + 32 + kk and of qh at 32 h + kk give k = kk, kk + 1 of four 32-k blocks g; 6-bit q: two steps per int16 run
// (2 * 16,002 < 2^15); then sc (qw . qx - 32 sum qx) in int32 and one FMA with d dx, as there.
template <int R, int P>
void gemv_i8_q6k_panels(const XQ& xq, const uint8_t* panel, int64_t pstride, float* acc) {
  constexpr int64_t pbb = 16 * quant_type(kQ6_K).block_bytes;
  constexpr int64_t sc_off = 32, ql_off = 288, qh_off = 2336;
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
  __m256 c[R * P][2];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < R * P; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
  const int64_t nb = xq.nb;
  for (int64_t sb = 0; sb < xq.K / 256; ++sb) {
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 2; ++s) {
        prefetch_stream(panel, (sb * 4 + h * 2 + s) * P * (pbb / 4), P * (pbb / 4));
        PAGEDSERVE_UNROLL
        for (int p = 0; p < P; ++p) {
          const uint8_t* pb = panel + p * pstride + sb * pbb;
          const int64_t b0 = sb * 8 + 4 * h;
          __m256i a[R][4][2];
          PAGEDSERVE_UNROLL
          for (int r = 0; r < R; ++r)
            for (int g = 0; g < 4; ++g) a[r][g][0] = a[r][g][1] = _mm256_setzero_si256();
          PAGEDSERVE_UNROLL
          for (int kk0 = 16 * s; kk0 < 16 * s + 16; kk0 += 4) {
            __m256i a16[R][4];
            PAGEDSERVE_UNROLL
            for (int r = 0; r < R; ++r)
              for (int g = 0; g < 4; ++g) a16[r][g] = _mm256_setzero_si256();
            PAGEDSERVE_UNROLL
            for (int kk = kk0; kk < kk0 + 4; kk += 2) {
              const __m256i la = pair_rows(pb + ql_off + 16 * (64 * h + kk));
              const __m256i lb = pair_rows(pb + ql_off + 16 * (64 * h + 32 + kk));
              const __m256i hb = pair_rows(pb + qh_off + 16 * (32 * h + kk));
              __m256i qv[4];
              qv[0] = _mm256_or_si256(_mm256_and_si256(la, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), two));
              qv[1] = _mm256_or_si256(_mm256_and_si256(lb, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), two));
              qv[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low4), _mm256_and_si256(hb, two));
              qv[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low4),
                                      _mm256_and_si256(_mm256_srli_epi16(hb, 2), two));
              PAGEDSERVE_UNROLL
              for (int r = 0; r < R; ++r)
                for (int g = 0; g < 4; ++g)
                  a16[r][g] = _mm256_add_epi16(
                      a16[r][g], _mm256_maddubs_epi16(qv[g], bcast16(xq.q + r * xq.K + (b0 + g) * 32 + kk)));
            }
            PAGEDSERVE_UNROLL
            for (int r = 0; r < R; ++r)
              for (int g = 0; g < 4; ++g) widen_add(a16[r][g], a[r][g][0], a[r][g][1]);
          }
          __m256 d0, d1;
          halves(pb, d0, d1);
          PAGEDSERVE_UNROLL
          for (int g = 0; g < 4; ++g) {
            const __m128i scb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pb + sc_off + 16 * (8 * h + 2 * g + s)));
            const __m256i sc[2] = {_mm256_cvtepi8_epi32(scb), _mm256_cvtepi8_epi32(_mm_srli_si128(scb, 8))};
            PAGEDSERVE_UNROLL
            for (int r = 0; r < R; ++r) {
              const int64_t b = b0 + g;
              const __m256i off = _mm256_set1_epi32(32 * xq.sq16[r * 2 * nb + 2 * b + s]);
              const __m256 dxv = _mm256_set1_ps(xq.dx[r * nb + b]);
              const __m256 dd[2] = {pinned(_mm256_mul_ps(d0, dxv)), pinned(_mm256_mul_ps(d1, dxv))};
              PAGEDSERVE_UNROLL
              for (int e = 0; e < 2; ++e) {
                const __m256i tt = _mm256_mullo_epi32(_mm256_sub_epi32(a[r][g][e], off), sc[e]);
                c[r * P + p][e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tt), dd[e], c[r * P + p][e]);
              }
            }
          }
        }
      }
    }
  }
  store_sums<R, P>(c, acc);
}

template <int64_t T, int P>
inline void gemv_i8_rows(int64_t R, const XQ& xq, const uint8_t* panel, int64_t pstride, float* acc) {
  switch (R) {
    case 1:
      if constexpr (T == kQ6_K) gemv_i8_q6k_panels<1, P>(xq, panel, pstride, acc);
      else if constexpr (T == kQ4_K || T == kQ5_K) gemv_i8_q4k_panels<T, 1, P>(xq, panel, pstride, acc);
      else gemv_i8_panels<T, 1, P>(xq, panel, pstride, acc);
      break;
    case 2:
      if constexpr (T == kQ6_K) gemv_i8_q6k_panels<2, P>(xq, panel, pstride, acc);
      else if constexpr (T == kQ4_K || T == kQ5_K) gemv_i8_q4k_panels<T, 2, P>(xq, panel, pstride, acc);
      else gemv_i8_panels<T, 2, P>(xq, panel, pstride, acc);
      break;
    case 3:
      if constexpr (T == kQ6_K) gemv_i8_q6k_panels<3, P>(xq, panel, pstride, acc);
      else if constexpr (T == kQ4_K || T == kQ5_K) gemv_i8_q4k_panels<T, 3, P>(xq, panel, pstride, acc);
      else gemv_i8_panels<T, 3, P>(xq, panel, pstride, acc);
      break;
    default:
      if constexpr (T == kQ6_K) gemv_i8_q6k_panels<4, P>(xq, panel, pstride, acc);
      else if constexpr (T == kQ4_K || T == kQ5_K) gemv_i8_q4k_panels<T, 4, P>(xq, panel, pstride, acc);
      else gemv_i8_panels<T, 4, P>(xq, panel, pstride, acc);
      break;
  }
}
#endif  // PAGEDSERVE_QUANT_I8_VNNI

// a / b rounded once: -ffast-math lets GCC compute a division as a product with a reciprocal (vector ones with
// vrcp14ps and a Newton step), another rounding, after which the ties of x / dx would round differently from the
// definition (and from llama.cpp).
inline float ieee_div(float a, float b) {
  float r;
  asm("vdivss %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
  return r;
}

// Rows of x (float32 or bf16, row stride xs) quantized per 32-k block into q / dx / sq / sq16 (XQ's layout; AVX2
// kernels: q16 too). A block holding a NaN or an infinity gets quants 0 and dx NaN, so that its row's outputs are NaN
// (the engine then fails that request) on every build; below 2^-100 the block is scaled by 2^64 first, exact, so
// that 127 / amax cannot overflow (the quants are those of an unbounded exponent range; dx may be denormal).
template <typename SX>
void quantize_rows_i8(const SX* x, int64_t xs, int64_t M, int64_t K, int8_t* q, float* dx, int32_t* sq,
                      int32_t* sq16, [[maybe_unused]] int16_t* q16) {
  const int64_t nb = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      alignas(64) float v[32];
      for (int i = 0; i < 32; ++i) v[i] = Elem<SX>::load(x[m * xs + b * 32 + i]);
      uint32_t top = 0;  // max |x| as float bits (a NaN or an infinity above every finite value), exact
      for (int i = 0; i < 32; ++i) {
        uint32_t bits;
        std::memcpy(&bits, v + i, 4);
        top = std::max(top, bits & 0x7FFFFFFFu);
      }
      if (top >= 0x7F800000u) {
        std::memset(q + m * K + b * 32, 0, 32);
        if (q16) std::memset(q16 + m * K + b * 32, 0, 32 * sizeof(int16_t));
        dx[m * nb + b] = std::numeric_limits<float>::quiet_NaN();
        sq16[(m * nb + b) * 2] = sq16[(m * nb + b) * 2 + 1] = sq[m * nb + b] = 0;
        continue;
      }
      float amax;
      std::memcpy(&amax, &top, 4);
      const float d = ieee_div(amax, 127.f);
      if (amax < 0x1p-100f) {
        for (int i = 0; i < 32; ++i) v[i] *= 0x1p64f;
        amax *= 0x1p64f;
      }
      const float s = amax > 0.f ? ieee_div(127.f, amax) : 0.f;
#ifdef PAGEDSERVE_QUANT_I8_VNNI
      const __m512 v0 = _mm512_load_ps(v), v1 = _mm512_load_ps(v + 16);
      const __m512 id = _mm512_set1_ps(s);
      const __m512i q0 = _mm512_cvtps_epi32(pinned(_mm512_mul_ps(v0, id)));  // nearest-even
      const __m512i q1 = _mm512_cvtps_epi32(pinned(_mm512_mul_ps(v1, id)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + b * 32), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + b * 32 + 16), _mm512_cvtsepi32_epi8(q1));
      dx[m * nb + b] = d;
      const int32_t h0 = _mm512_reduce_add_epi32(q0), h1 = _mm512_reduce_add_epi32(q1);
#else  // the same steps on 8 lanes (each product rounds once, then nearest-even)
      const __m256 id = _mm256_set1_ps(s);
      alignas(32) int32_t qi[32];
      for (int i = 0; i < 32; i += 8)
        _mm256_store_si256(reinterpret_cast<__m256i*>(qi + i),
                           _mm256_cvtps_epi32(pinned(_mm256_mul_ps(_mm256_load_ps(v + i), id))));
      int32_t h0 = 0, h1 = 0;
      for (int i = 0; i < 32; ++i) {
        const int32_t qv = std::clamp(qi[i], -127, 127);  // |x| * 127 / max rounds to at most 127 already
        q[m * K + b * 32 + i] = static_cast<int8_t>(qv);
        q16[m * K + b * 32 + i] = static_cast<int16_t>(qv);
        (i < 16 ? h0 : h1) += qv;
      }
      dx[m * nb + b] = d;
#endif
      sq16[(m * nb + b) * 2] = h0;
      sq16[(m * nb + b) * 2 + 1] = h1;
      sq[m * nb + b] = h0 + h1;
    }
  }
}

template <int64_t T, typename OT>
void quant_gemv_i8(const XQ& xq, const uint8_t* w, const float* bias, OT* y, int64_t M, int64_t N) {
  constexpr QuantType t = quant_type(T);
  const int64_t panels = (N + 15) / 16, pstride = 16 * (xq.K / t.block_size) * t.block_bytes;
  for (int64_t m0 = 0; m0 < M; m0 += kGemvRows) {  // rows past 4: again, 4 at a time (the same chains per row)
    const int64_t mr = std::min<int64_t>(kGemvRows, M - m0);
    const XQ part{xq.q + m0 * xq.K, xq.dx + m0 * xq.nb, xq.sq + m0 * xq.nb, xq.sq16 + m0 * 2 * xq.nb,
                  xq.q16 ? xq.q16 + m0 * xq.K : nullptr, xq.K, xq.nb};
    // Two panels per task for one row (8 independent chains); one from 3 rows (2 for the K-quants), where the rows'
    // own chains are enough and GCC spills the 2-panel kernels' accumulators and sums to the stack inside the block
    // loop (objdump: 48 stack moves per 64 vpdpbusd at 4 rows). In cache, 1,536 x 1,024, 4 rows: Q6_K 77.6 -> 39.4
    // us, Q4_K 34.7 -> 28.0, Q4_1 53.1 -> 49.8; 2 rows of Q4_K 20.9 -> 17.0. The same chains either way.
    constexpr bool kquant = T == kQ4_K || T == kQ5_K || T == kQ6_K;
    const int P = mr >= 3 || (mr == 2 && kquant) ? 1 : 2;
    gemv_groups(mr, P, panels, w, pstride, bias, y + m0 * N, N, [&](int np, int64_t p0, float* acc) {
      if (np == 2) {
        gemv_i8_rows<T, 2>(mr, part, w + p0 * pstride, pstride, acc);
      } else {
        gemv_i8_rows<T, 1>(mr, part, w + p0 * pstride, pstride, acc);
      }
    });
  }
}
#endif

// Runs body.template operator()<T>() with the type id as a template argument.
template <typename F>
inline void dispatch_type(int64_t type, F&& body) {
  switch (type) {
    case kQ4_0: body.template operator()<kQ4_0>(); break;
    case kQ4_1: body.template operator()<kQ4_1>(); break;
    case kQ5_0: body.template operator()<kQ5_0>(); break;
    case kQ5_1: body.template operator()<kQ5_1>(); break;
    case kQ8_0: body.template operator()<kQ8_0>(); break;
    case kQ4_K: body.template operator()<kQ4_K>(); break;
    case kQ5_K: body.template operator()<kQ5_K>(); break;
    case kQ6_K: body.template operator()<kQ6_K>(); break;
    default:
      TORCH_CHECK(!(type & kLanes) || (base_type(type) != kQ4_0 && base_type(type) != kQ4_1),
                  "quant: type id ", type, " (lane-local packing) is read by the bf16 route only");
      TORCH_CHECK(false, "quant: ggml type ", type, " is not one of the quantized types read in place");
  }
}

// dispatch_type for the bf16 route, which also reads the lane-local packing where the build has it.
template <typename F>
inline void dispatch_type_bf16(int64_t type, F&& body) {
#ifdef PAGEDSERVE_QUANT_LANES
  if (type == kQ4_0L) return body.template operator()<kQ4_0L>();
  if (type == kQ4_1L) return body.template operator()<kQ4_1L>();
#endif
  dispatch_type(type, std::forward<F>(body));
}

// The packed tensor of `packed` checked against the type; returns K (weights per row) and the panel count.
const torch::Tensor& checked_packed(const std::vector<torch::Tensor>& packed, const QuantType& t, const char* what,
                                    int64_t& K, int64_t& panels) {
  TORCH_CHECK(packed.size() == 1, what, ": packed must be quant_pack's list (one tensor)");
  const torch::Tensor& p = packed[0];
  TORCH_CHECK(p.dim() == 2 && p.scalar_type() == torch::kUInt8 && p.is_contiguous() && p.size(1) > 0 &&
                  p.size(1) % (16 * t.block_bytes) == 0,
              what, ": packed is not a ", t.name, " weight packed by quant_pack");
  K = p.size(1) / (16 * t.block_bytes) * t.block_size;
  panels = p.size(0);
  return p;
}

// A matmul's bias (N elements, any float dtype) as contiguous float32, or an undefined tensor without one.
torch::Tensor checked_bias(const c10::optional<torch::Tensor>& bias, int64_t N, const char* what) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->numel() == N, what, ": bias must have N elements");
  return bias->to(torch::kFloat32).contiguous();
}

// A matmul's arguments against its packed weight (x [M, K] with contiguous rows, N, out_dtype); returns the
// packed tensor.
const torch::Tensor& checked_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& packed, int64_t type,
                                    int64_t N, int64_t K, c10::ScalarType out_dtype, const char* what) {
  const QuantType& t = checked_type(type, what);
  int64_t pk, panels;
  const torch::Tensor& p = checked_packed(packed, t, what, pk, panels);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == K && pk == K,
              what, ": x must be [M, K] with contiguous rows, K the packed weight's (", pk, ")");
  TORCH_CHECK(N >= 1 && panels == (N + 15) / 16, what, ": N does not match the packed weight");
  TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16,
              what, ": out_dtype must be float32 or bfloat16");
  return p;
}

}  // namespace
}  // namespace quant_detail

std::vector<int64_t> quant_types() {
  using namespace quant_detail;
  std::vector<int64_t> out;
  for (const auto& t : kQuantTypes)
    if (!(t.id & kLanes)) out.push_back(t.id);
  return out;
}

bool quant_type_known(int64_t type) {
  using namespace quant_detail;
  if (type & kLanes) return quant_lanes_type(base_type(type)) == type;
  const auto types = quant_types();
  return std::find(types.begin(), types.end(), type) != types.end();
}

// The type id of the lane-local packing of ggml type `type` (quant_relayout), where this build's bf16 route reads it
// (Q4_0, Q4_1 with AVX512-BF16 and VBMI), else -1.
int64_t quant_lanes_type(int64_t type) {
  using namespace quant_detail;
#ifdef PAGEDSERVE_QUANT_LANES
  if (type == kQ4_0 || type == kQ4_1) return kLanes | type;
#endif
  (void)type;
  return -1;
}

// Regroups each block of `packed` (quant_pack's list of a from_type weight) in place into to_type's packing: a
// ggml type and its lane-local packing (quant_lanes_type), either way. The bytes stay the file's, only moved.
void quant_relayout(std::vector<torch::Tensor> packed, int64_t from_type, int64_t to_type) {
  using namespace quant_detail;
  const QuantType& f = checked_type(from_type, "quant_relayout");
  const QuantType& t = checked_type(to_type, "quant_relayout");
  TORCH_CHECK(base_type(from_type) == base_type(to_type) && quant_type_known(from_type) && quant_type_known(to_type),
              "quant_relayout: ", f.name, " cannot be repacked as ", t.name, " here");
  int64_t K, panels;
  const torch::Tensor& p = checked_packed(packed, f, "quant_relayout", K, panels);
  if (from_type == to_type) return;
  uint8_t* w = p.data_ptr<uint8_t>();
  const int64_t blocks = panels * (K / f.block_size), bytes = 16 * f.block_bytes;
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> tmp(bytes), blk(f.block_bytes);
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t* pb = w + b * bytes;
      for (int64_t r = 0; r < 16; ++r) {
        gather_row(f, pb, r, blk.data());
        scatter_row(t, blk.data(), tmp.data(), r);
      }
      std::memcpy(pb, tmp.data(), bytes);
    }
  });
}

// raw: uint8 [N, row_bytes] (the file's rows of blocks) -> [packed], packed uint8 [ceil(N / 16), 16 * row_bytes].
std::vector<torch::Tensor> quant_pack(torch::Tensor raw, int64_t type) {
  using namespace quant_detail;
  const QuantType& t = checked_type(type, "quant_pack");
  TORCH_CHECK(!(type & kLanes), "quant_pack: packs ggml types (quant_relayout makes the lane-local packing)");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.size(0) >= 1 && raw.size(1) > 0 &&
                  raw.size(1) % t.block_bytes == 0,
              "quant_pack: raw must be uint8 [N, row_bytes] with whole ", t.name, " blocks per row");
  const torch::Tensor src = raw.contiguous();
  const int64_t N = src.size(0), rb = src.size(1), nb = rb / t.block_bytes, panels = (N + 15) / 16;
  auto out = torch::zeros({panels, 16 * rb}, torch::kUInt8);
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* d = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < 16 && p * 16 + r < N; ++r)
        for (int64_t b = 0; b < nb; ++b)
          scatter_row(t, s + (p * 16 + r) * rb + b * t.block_bytes, d + p * 16 * rb + b * 16 * t.block_bytes, r);
  });
  return {out};
}

// y = x @ W.T (+ bias), W the dequantized [N, K] weight; x [M, K] float32 or bf16 (contiguous rows, any row
// stride); bias [N] (any float dtype, added in float32); out_dtype float32 or bf16 (rounded once, at the end).
torch::Tensor quant_linear(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N, int64_t K,
                           c10::optional<torch::Tensor> bias, c10::ScalarType out_dtype) {
  using namespace quant_detail;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "quant_linear: x must be float32 or bfloat16");
  const torch::Tensor& p = checked_linear(x, packed, type, N, K, out_dtype, "quant_linear");
  const int64_t M = x.size(0);
  auto xf = x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
  const torch::Tensor bf = checked_bias(bias, N, "quant_linear");
  auto y = matmul_output(M, N, x.options().dtype(out_dtype));
  if (M == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const uint8_t* wp = p.data_ptr<uint8_t>();
  dispatch_type(type, [&]<int64_t T>() {
    dispatch_float_bf16(y, "quant_linear", [&]<typename OT>() {
      quant_gemm<T, OT>(xp, xf.stride(0), wp, bp, ptr<OT>(y), M, N, K);
    });
  });
  return y;
}

// SwiGLU over quant_linear: silu(gate) * up of y = x @ W.T, W = [gate; up] (N = 2 I rows, I % 16 == 0, no bias),
// float32 x and out [M, I]: the same bits as silu_and_mul(quant_linear(x, ..., float32)), fused where AVX2 + FMA + F16C
// are built (the [M, 2 I] product is never written: the many-rows kernel's epilogue, or for few rows each gate panel
// with its up panel in one GEMV task), else those two ops.
torch::Tensor quant_linear_silu(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N,
                                int64_t K) {
  using namespace quant_detail;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "quant_linear_silu: x must be float32");
  TORCH_CHECK(N > 0 && N % 32 == 0, "quant_linear_silu: n must be 2 I with I a multiple of 16, got ", N);
  const torch::Tensor& p = checked_linear(x, packed, type, N, K, torch::kFloat32, "quant_linear_silu");
#ifdef PAGEDSERVE_QUANT_AVX2
  const int64_t M = x.size(0);
  auto y = matmul_output(M, N / 2, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = p.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  dispatch_type(type, [&]<int64_t T>() { quant_gemm<T, float, true>(xp, x.stride(0), wp, nullptr, yp, M, N, K); });
  return y;
#else
  (void)p;
  return silu_and_mul(quant_linear(x, packed, type, N, K, c10::nullopt, torch::kFloat32));
#endif
}

bool has_quant_bf16() {
#ifdef PAGEDSERVE_QUANT_BF16
  return true;
#else
  return false;
#endif
}

bool has_amx() {
#ifdef PAGEDSERVE_QUANT_AMX
  return true;
#else
  return false;
#endif
}

// Whether the AMX routes (quant_linear_bf16 here, attention.cpp's bf16 prefill rows) run in this process: built,
// switched on, and the kernel granted the tile data state (asked once: arch_prctl ARCH_REQ_XCOMP_PERM). set_amx
// switches them (tests and benchmarks compare the routes).
bool amx_active() {
#ifdef PAGEDSERVE_QUANT_AMX
  return quant_detail::g_amx_on.load(std::memory_order_relaxed) && amx::granted();
#else
  return false;
#endif
}

bool set_amx(bool enabled) {
  quant_detail::g_amx_on.store(enabled);
  return amx_active();
}

// y = x @ Wb.T (+ bias), Wb the dequantized weight rounded to bf16 (nearest-even); x [M, K] bf16 (contiguous
// rows, any row stride); bias [N] (added in float32); out_dtype float32 or bf16 (rounded once, at the end).
// AVX512-BF16 builds only (has_quant_bf16).
torch::Tensor quant_linear_bf16(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N, int64_t K,
                                c10::optional<torch::Tensor> bias, c10::ScalarType out_dtype) {
  using namespace quant_detail;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "quant_linear_bf16: x must be bfloat16");
  const torch::Tensor& p = checked_linear(x, packed, type, N, K, out_dtype, "quant_linear_bf16");
  const torch::Tensor bf = checked_bias(bias, N, "quant_linear_bf16");
  const int64_t M = x.size(0);
  auto y = matmul_output(M, N, x.options().dtype(out_dtype));
  if (M == 0) return y;
#ifdef PAGEDSERVE_QUANT_BF16
  const uint16_t* xp = ptr<uint16_t>(x);
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const uint8_t* wp = p.data_ptr<uint8_t>();
  dispatch_type_bf16(type, [&]<int64_t T>() {
    dispatch_float_bf16(y, "quant_linear_bf16", [&]<typename OT>() {
      quant_gemm_bf16<T, OT>(xp, x.stride(0), wp, bp, ptr<OT>(y), M, N, K);
    });
  });
  return y;
#else
  TORCH_CHECK(false, "quant_linear_bf16: this build has no AVX512-BF16");
  return y;
#endif
}

// Greedy decoding over quant_linear_bf16 (an LM head): int64 [M], each row's index of the first maximum of its float32
// logits y = x @ Wb.T (+ bias) as quant_linear_bf16 computes them, or -1 where one is NaN (RowArgmax). Where the
// many-rows kernels run the logits are never written (their epilogue hands them to RowArgmax); a few rows' are
// computed as they are and reduced the same way.
torch::Tensor quant_linear_bf16_argmax(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N,
                                       int64_t K, c10::optional<torch::Tensor> bias,
                                       c10::optional<torch::Tensor> screen) {
  using namespace quant_detail;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "quant_linear_bf16_argmax: x must be bfloat16");
  TORCH_CHECK(N > 0, "quant_linear_bf16_argmax: n must be positive");
  const torch::Tensor& p = checked_linear(x, packed, type, N, K, torch::kFloat32, "quant_linear_bf16_argmax");
  const torch::Tensor bf = checked_bias(bias, N, "quant_linear_bf16_argmax");
  if (screen && screen->numel()) {  // quant_screen_i8_norms of this weight (checked at every row count)
    const int64_t panels = (N + 15) / 16;
    TORCH_CHECK(type == quant_detail::kQ8_0 && screen->scalar_type() == torch::kFloat32 && screen->is_contiguous() &&
                    screen->numel() == quant_detail::i8_norms_size(panels, K / 32),
                "quant_linear_bf16_argmax: screen must be quant_screen_i8_norms' tensor of this weight");
  }
  const int64_t M = x.size(0);
  if (M == 0) return torch::empty({0}, torch::kInt64);
#ifdef PAGEDSERVE_QUANT_BF16
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const Bf16Route route;
  if (M <= route.few) {  // the few rows' logits (M x N floats), then the same reduction (bias already in them), in
                   // parallel over rows and, for fewer rows than threads, column ranges
    const torch::Tensor y = quant_linear_bf16(x, packed, type, N, K, bias, torch::kFloat32);
    const float* yp = y.data_ptr<float>();
    const int64_t threads = at::get_num_threads(), panels = (N + 15) / 16;
    const int64_t parts = std::clamp<int64_t>(threads / M, 1, panels);
    RowArgmax am(M, threads);
    at::parallel_for(0, M * parts, 1, [&](int64_t i0, int64_t i1) {
      const int64_t t = at::get_thread_num();
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / parts, c = i % parts, p0 = c * panels / parts, p1 = (c + 1) * panels / parts;
        am.update(t, yp + r * N + p0 * 16, N, 1, r, static_cast<int>(p1 - p0), p0, nullptr, N);
      }
    });
    return am.result();
  }
  const uint16_t* xp = ptr<uint16_t>(x);
  const uint8_t* wp = p.data_ptr<uint8_t>();
  if (screen && screen->numel()) {  // the screened head where it applies
#ifdef PAGEDSERVE_SCREEN_I8
    const int64_t nb = K / 32, panels = (N + 15) / 16;
    if (!route.amx && !bf.defined()) {
      torch::Tensor out = torch::empty({M}, torch::kInt64);
      const float* sp = screen->data_ptr<float>();
      screened_argmax_bf16(xp, x.stride(0), wp, {sp, sp + panels * nb * 16}, M, N, K, out.data_ptr<int64_t>());
      return out;
    }
#endif
  }
  RowArgmax am(M, at::get_num_threads());
  dispatch_type_bf16(type, [&]<int64_t T>() { route.rows<T, float>(xp, x.stride(0), wp, bp, nullptr, M, N, K, &am); });
  return am.result();
#else
  (void)p;
  (void)bf;
  TORCH_CHECK(false, "quant_linear_bf16_argmax: this build has no AVX512-BF16");
  return torch::Tensor();
#endif
}

// The bf16 route's screened greedy head's norms (quant_linear_bf16_argmax's screen): float32, per panel p of 16 columns
// and 32-k block b the 16 columns' sums of |w| over the block at (p * nb + b) * 16 (rounded up; zeros past N), then
// per 16 panels P and block b each panel's largest of those at panels * nb * 16 + (P * nb + b) * 16 + p % 16; an empty
// tensor where this weight cannot be screened (another type, a non-finite scale d, or a build without AVX512-VNNI and
// AVX512-BF16). Once per weight.
torch::Tensor quant_screen_i8_norms(std::vector<torch::Tensor> packed, int64_t type, int64_t N, int64_t K) {
  using namespace quant_detail;
  const QuantType& t = checked_type(type, "quant_screen_i8_norms");
  int64_t pk, panels;
  const torch::Tensor& p = checked_packed(packed, t, "quant_screen_i8_norms", pk, panels);
  TORCH_CHECK(pk == K && N >= 1 && panels == (N + 15) / 16,
              "quant_screen_i8_norms: N / K do not match the packed weight");
#ifdef PAGEDSERVE_SCREEN_I8
  if (type != kQ8_0) return torch::empty({0}, torch::kFloat32);
  const int64_t nb = K / 32, groups = (panels + 15) / 16;
  auto out = torch::zeros({i8_norms_size(panels, nb)}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  float* loose = o + panels * nb * 16;
  const uint8_t* w = p.data_ptr<uint8_t>();
  std::atomic<bool> finite{true};
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t pi = g0 * 16; pi < std::min(panels, g1 * 16); ++pi) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* pb = w + (pi * nb + b) * kQ8Block;
        float top = 0.f;
        for (int64_t r = 0; r < 16 && pi * 16 + r < N; ++r) {
          double l1;
          if (!q8_block_l1(pb, r, l1)) finite = false;
          const float f = float_up(l1);
          o[(pi * nb + b) * 16 + r] = f;
          top = std::max(top, f);
        }
        loose[((pi / 16) * nb + b) * 16 + pi % 16] = top;
      }
    }
  });
  if (!finite) return torch::empty({0}, torch::kFloat32);
  return out;
#else
  (void)p;
  return torch::empty({0}, torch::kFloat32);
#endif
}

// The screened greedy head's column norms: float32 [ceil(N / 16) * 16], column n's sum_k |w_nk| over the dequantized
// Q8_0 weight, rounded up (zeros past N); an empty tensor where this weight cannot be screened (another type, a
// non-finite scale d, or a build without AVX2). Once per weight, for quant_linear_argmax.
torch::Tensor quant_screen_norms(std::vector<torch::Tensor> packed, int64_t type, int64_t N, int64_t K) {
  using namespace quant_detail;
  const QuantType& t = checked_type(type, "quant_screen_norms");
  int64_t pk, panels;
  const torch::Tensor& p = checked_packed(packed, t, "quant_screen_norms", pk, panels);
  TORCH_CHECK(pk == K && N >= 1 && panels == (N + 15) / 16, "quant_screen_norms: N / K do not match the packed weight");
#ifdef PAGEDSERVE_QUANT_AVX2
  if (type != kQ8_0) return torch::empty({0}, torch::kFloat32);
  auto out = torch::zeros({panels * 16}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const uint8_t* w = p.data_ptr<uint8_t>();
  const int64_t nb = K / 32;
  std::atomic<bool> finite{true};
  at::parallel_for(0, panels, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t pi = p0; pi < p1; ++pi) {
      for (int64_t r = 0; r < 16 && pi * 16 + r < N; ++r) {
        double sum = 0;
        for (int64_t b = 0; b < nb; ++b) {
          double l1;
          if (!q8_block_l1(w + (pi * nb + b) * kQ8Block, r, l1)) finite = false;
          sum += l1;
        }
        o[pi * 16 + r] = float_up(sum);
      }
    }
  });
  if (!finite) return torch::empty({0}, torch::kFloat32);
  return out;
#else
  (void)p;
  return torch::empty({0}, torch::kFloat32);
#endif
}

// Greedy decoding over quant_linear (float32 x, a Q8_0 LM head, no bias): int64 [M], each row's index of the first
// maximum of its float32 logits quant_linear(x, ...) (argmax_rows' index), or -1 where one is NaN, from the screen
// above: the logits are never written, and only the columns that can hold a row's maximum get their exact chain.
// norms: quant_screen_norms(packed, ...) (non-empty).
torch::Tensor quant_linear_argmax(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N,
                                  int64_t K, torch::Tensor norms) {
  using namespace quant_detail;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "quant_linear_argmax: x must be float32");
  TORCH_CHECK(type == kQ8_0, "quant_linear_argmax: the weight must be Q8_0");
  const torch::Tensor& p = checked_linear(x, packed, type, N, K, torch::kFloat32, "quant_linear_argmax");
  TORCH_CHECK(norms.scalar_type() == torch::kFloat32 && norms.dim() == 1 && norms.is_contiguous() &&
                  norms.size(0) == p.size(0) * 16,
              "quant_linear_argmax: norms must be quant_screen_norms' float32 [ceil(n / 16) * 16] of this weight");
  const int64_t M = x.size(0);
  auto out = torch::empty({M}, torch::kInt64);
  if (M == 0) return out;
#ifdef PAGEDSERVE_QUANT_AVX2
  screened_argmax(x.data_ptr<float>(), x.stride(0), p.data_ptr<uint8_t>(), norms.data_ptr<float>(), M, N, K,
                  out.data_ptr<int64_t>());
#else
  TORCH_CHECK(false, "quant_linear_argmax: this build has no AVX2 + FMA + F16C");
#endif
  return out;
}

// SwiGLU over quant_linear_bf16: silu(gate) * up of y = x @ Wb.T, W = [gate; up] (N = 2 I rows, I % 16 == 0, no
// bias), bf16 out [M, I]: the same bits as silu_and_mul(quant_linear_bf16(x, ..., bf16)), fused on every route (the
// [M, 2 I] product is never written): the many-rows kernels' epilogue, or for few rows gemv_silu_pairs.
torch::Tensor quant_linear_bf16_silu(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N,
                                     int64_t K) {
  using namespace quant_detail;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "quant_linear_bf16_silu: x must be bfloat16");
  TORCH_CHECK(N > 0 && N % 32 == 0, "quant_linear_bf16_silu: n must be 2 I with I a multiple of 16, got ", N);
  const torch::Tensor& p = checked_linear(x, packed, type, N, K, torch::kBFloat16, "quant_linear_bf16_silu");
  const int64_t M = x.size(0);
#ifdef PAGEDSERVE_QUANT_BF16
  // Fused in the many-rows kernel's epilogue (AMX: above kAmxGemvRows rows; vdpbf16ps: above kGemvRows).
  const Bf16Route route;
  if (M > route.few) {
    auto y = matmul_output(M, N / 2, x.options());
    const uint16_t* xp = ptr<uint16_t>(x);
    const uint8_t* wp = p.data_ptr<uint8_t>();
    dispatch_type_bf16(type, [&]<int64_t T>() {
      route.rows<T, uint16_t, true>(xp, x.stride(0), wp, nullptr, ptr<uint16_t>(y), M, N, K);
    });
    return y;
  }
  // Few rows: each gate panel with its up panel in one few-rows kernel call (their P = 2, the up half's offset as the
  // panel stride), the SwiGLU in the driver.
  auto y = matmul_output(M, N / 2, x.options());
  if (M == 0) return y;
  const uint16_t* xp = ptr<uint16_t>(x);
  const uint8_t* wp = p.data_ptr<uint8_t>();
  const int64_t xs = x.stride(0), pairs = N / 32;
  uint16_t* yp = ptr<uint16_t>(y);
  dispatch_type_bf16(type, [&]<int64_t T>() {
    constexpr QuantType t = quant_type(T);
    const int64_t pstride = 16 * (K / t.block_size) * t.block_bytes, up = pairs * pstride;
    const auto silu = [&](int64_t g, const float* acc) {
      for (int64_t r = 0; r < M; ++r) silu_store16(acc + r * 32, 16, yp + r * pairs * 16 + g * 16);
    };
#ifdef PAGEDSERVE_QUANT_AMX
    if (route.amx) {
      gemv_silu_pairs<kAmxGemvRows>(
          pairs, wp, pstride,
          [&](int64_t g, float* acc) { gemv_amx<T, 2, true>(xp, xs, wp + g * pstride, up, K, acc, 32); }, silu,
          [&] { return amx::Tiles(static_cast<int>(M)); });
      return;
    }
#endif
    gemv_silu_pairs(
        pairs, wp, pstride,
        [&](int64_t g, float* acc) { gemv_bf16_rows<T, 2, true>(M, xp, xs, wp + g * pstride, up, K, acc); }, silu);
  });
  return y;
#else
  (void)p;
  return silu_and_mul(quant_linear_bf16(x, packed, type, N, K, c10::nullopt, torch::kBFloat16));
#endif
}

bool has_quant_i8() {
#ifdef PAGEDSERVE_QUANT_I8
  return true;
#else
  return false;
#endif
}

// Whether quant_linear_i8 runs the AVX512-VNNI + VBMI kernels (else the AVX2 ones; the same bits).
bool has_quant_i8_vnni() {
#ifdef PAGEDSERVE_QUANT_I8_VNNI
  return true;
#else
  return false;
#endif
}

// The ggml type ids quant_linear_i8 takes in this build: every type read in place with AVX2 (AVX512-VNNI + VBMI
// kernels or the AVX2 ones), none without.
std::vector<int64_t> quant_i8_types() {
  using namespace quant_detail;
#if defined(PAGEDSERVE_QUANT_I8)
  return {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K};
#else
  return {};
#endif
}

// y = W . Q(x) (+ bias): W the dequantized Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weight, Q(x) x's rows
// quantized to int8 per 32-k block (llama.cpp's activations; see quant_gemv_i8's section). x [M, K] float32 or bf16
// (contiguous rows, any row stride); bias [N] (added in float32); out_dtype float32 or bf16 (rounded once, at the end).
// A row's result is the same bits whatever M. Builds with AVX2 (has_quant_i8), for the types of quant_i8_types: the
// same bits on AVX2 as with AVX512-VNNI + VBMI.
torch::Tensor quant_linear_i8(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t type, int64_t N, int64_t K,
                              c10::optional<torch::Tensor> bias, c10::ScalarType out_dtype) {
  using namespace quant_detail;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "quant_linear_i8: x must be float32 or bfloat16");
  TORCH_CHECK(type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1 || type == kQ8_0 || type == kQ4_K ||
                  type == kQ5_K || type == kQ6_K,
              "quant_linear_i8: ggml type ", type, " is not Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K");
  const torch::Tensor& p = checked_linear(x, packed, type, N, K, out_dtype, "quant_linear_i8");
  const torch::Tensor bf = checked_bias(bias, N, "quant_linear_i8");
  const int64_t M = x.size(0);
  auto y = matmul_output(M, N, x.options().dtype(out_dtype));
  if (M == 0) return y;
#ifdef PAGEDSERVE_QUANT_I8
  const int64_t nb = K / 32;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> dx;
  thread_local std::vector<int32_t> sq, sq16;
  thread_local std::vector<int16_t> q16;
  q.resize(M * K);
#ifndef PAGEDSERVE_QUANT_I8_VNNI
  q16.resize(M * K);
#endif
  dx.resize(M * nb);
  sq.resize(M * nb);
  sq16.resize(M * nb * 2);
  dispatch_float_bf16(x, "quant_linear_i8", [&]<typename SX>() {
    quantize_rows_i8<SX>(ptr<SX>(x), x.stride(0), M, K, q.data(), dx.data(), sq.data(), sq16.data(), q16.data());
  });
  const XQ xq{q.data(), dx.data(), sq.data(), sq16.data(), q16.empty() ? nullptr : q16.data(), K, nb};
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const uint8_t* wp = p.data_ptr<uint8_t>();
  dispatch_float_bf16(y, "quant_linear_i8", [&]<typename OT>() {
    switch (type) {
      case kQ4_0: quant_gemv_i8<kQ4_0, OT>(xq, wp, bp, ptr<OT>(y), M, N); break;
      case kQ4_1: quant_gemv_i8<kQ4_1, OT>(xq, wp, bp, ptr<OT>(y), M, N); break;
      case kQ5_0: quant_gemv_i8<kQ5_0, OT>(xq, wp, bp, ptr<OT>(y), M, N); break;
      case kQ5_1: quant_gemv_i8<kQ5_1, OT>(xq, wp, bp, ptr<OT>(y), M, N); break;
      case kQ4_K: quant_gemv_i8<kQ4_K, OT>(xq, wp, bp, ptr<OT>(y), M, N); break;
      case kQ5_K: quant_gemv_i8<kQ5_K, OT>(xq, wp, bp, ptr<OT>(y), M, N); break;
      case kQ6_K: quant_gemv_i8<kQ6_K, OT>(xq, wp, bp, ptr<OT>(y), M, N); break;
      default: quant_gemv_i8<kQ8_0, OT>(xq, wp, bp, ptr<OT>(y), M, N); break;
    }
  });
  return y;
#else
  (void)p;
  TORCH_CHECK(false, "quant_linear_i8: this build has no AVX2 + FMA + F16C");
  return y;
#endif
}

// The dequantized rows ids (any shape, int64; each below 16 * panels: rows of the padding are 0) -> [..., K].
torch::Tensor quant_embedding(torch::Tensor ids, std::vector<torch::Tensor> packed, int64_t type, int64_t K,
                              c10::ScalarType out_dtype) {
  using namespace quant_detail;
  const QuantType& t = checked_type(type, "quant_embedding");
  int64_t pk, panels;
  const torch::Tensor& p = checked_packed(packed, t, "quant_embedding", pk, panels);
  TORCH_CHECK(pk == K, "quant_embedding: K does not match the packed weight (", pk, ")");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64, "quant_embedding: ids must be int64");
  TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16,
              "quant_embedding: out_dtype must be float32 or bfloat16");
  const torch::Tensor idc = ids.contiguous();
  const int64_t T = idc.numel();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < panels * 16, "quant_embedding: id ", id[i], " is outside the weight");
  std::vector<int64_t> shape(idc.sizes().begin(), idc.sizes().end());
  shape.push_back(K);
  auto out = torch::empty(shape, torch::TensorOptions().dtype(out_dtype));
  const uint8_t* wp = p.data_ptr<uint8_t>();
  const int64_t pstride = p.size(1), nb = K / t.block_size;
  dispatch_type(base_type(type), [&]<int64_t TT>() {  // (t: this packing, lane-local or not)
    constexpr QuantType q = quant_type(TT);
    dispatch_float_bf16(out, "quant_embedding", [&]<typename OT>() {
      OT* o = ptr<OT>(out);
      at::parallel_for(0, T, 8, [&](int64_t i0, int64_t i1) {
        uint8_t blk[q.block_bytes];
        float vals[q.block_size];
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t n = id[i];
          for (int64_t b = 0; b < nb; ++b) {
            gather_row(t, wp + (n / 16) * pstride + b * 16 * q.block_bytes, n % 16, blk);
            dequant_block<TT>(blk, vals);
            for (int64_t j = 0; j < q.block_size; ++j) o[i * K + b * q.block_size + j] = Elem<OT>::store(vals[j]);
          }
        }
      });
    });
  });
  return out;
}

}  // namespace pagedserve
