// What the bf16 few-rows GEMV's widening costs on an AVX512-BF16 CPU without AMX (Zen 4), in cycles per pair vector
// (32 bf16 weights: 16 rows x a k pair), and what other layouts of a Q4_1 panel's quants would cost. Benchmark-only:
// not part of the extension. Build and run (one thread, the panels hot in L2):
//
//   g++ -O3 -march=native -std=c++20 -o /tmp/widen_costs benchmarks/avx512/widen_costs.cpp && /tmp/widen_costs
//
// Cycles are TSC ticks / TSC_PER_CYCLE (environment; default 0.714: a 2.6 GHz TSC under a 3.63 GHz core, as measured
// on the twenty-ninth part's Zen 4 by a dependent add chain). Forms, each R rows x P panels over K = 576 (the
// bundled model's hidden size), Q4_1 with make's magic form (the quant as a float's mantissa byte, one FMA per 16
// weights, vcvtne2ps2bf16, vdpbf16ps):
//  - vpermb:      quant_gemm.cpp's FastPairs<Q4_1>::get2 on today's layout (byte planes of 16 rows): per pair vector two
//                 merge-masked vpermb move each row's (k, k + 1) quants into the lanes of two float vectors (the
//                 few-rows GEMV's form for Q4_0 / Q4_1 until the thirty-eighth part).
//  - nibbles:     FastPairs::get4, the GEMV's form since then: one unmasked vpermb per row half moves each lane's raw
//                 byte (both nibbles) into all four bytes of the lane; a vpternlogd gives pair vector j's float (low
//                 nibble) and, after a 4-bit shift, pair vector j + 8's (high nibble), held until its turn.
//  - lane-local:  a layout that does not exist in the extension: each 64-byte load holds, in dword lane l, eight quants
//                 of row l / 2 (rows 8.. in the next 64 bytes), k = 2 s + l % 2 in nibble s, so a float vector is a
//                 shift and one vpternlogd (nibble & 0xF, | 2.0f) of a load: no lane crossing.
//  - floor:       lane-local without the extraction (the loads used as the float vectors: wrong values): what the
//                 two FMAs, the conversion and the dot product cost alone.
#include <immintrin.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#define UNROLL _Pragma("GCC unroll 32")

namespace {

constexpr int64_t kK = 576, kBlockBytes = 320, kPanels = 8;  // a panel's Q4_1 block: d (32 B), m (32 B), quants

inline void pairs(__m512 v, __m512& lo, __m512& hi) {  // row vector -> (v_r, v_r) for rows 0-7 and 8-15
  const __m512i l = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  lo = _mm512_permutexvar_ps(l, v);
  hi = _mm512_permutexvar_ps(_mm512_add_epi32(l, _mm512_set1_epi32(8)), v);
}

struct Scales {  // make's magic form: F = 2 + q / 64, fma(F, 64 d, m - 128 d) = d q + m
  __m512 d0, d1, m0, m1;
  void init(const uint8_t* pb) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 32)));
    const __m512 sD = _mm512_mul_ps(d, _mm512_set1_ps(-64.f));
    pairs(_mm512_mul_ps(d, _mm512_set1_ps(64.f)), d0, d1);
    pairs(_mm512_add_ps(m, _mm512_add_ps(sD, sD)), m0, m1);
  }
  // The pair vector of magic-form floats F0 (rows 0-7) and F1 (rows 8-15): FastPairs::magic_pair.
  __m512bh pair(__m512 F0, __m512 F1) const {
    return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(F1, d1, m1), _mm512_fmadd_ps(F0, d0, m0));
  }
};

// The 32-k block at k0 of P panels: its bytes and scales.
template <int P>
inline void block_start(const uint8_t* panel, int64_t pstride, int64_t k0, const uint8_t** pb, Scales* sc) {
  UNROLL
  for (int p = 0; p < P; ++p) {
    pb[p] = panel + p * pstride + (k0 / 32) * kBlockBytes;
    sc[p].init(pb[p]);
  }
}

inline __m512i byte_idx(int row0, int half) {  // FastPairs::byte_idx
  const auto b = [=](int l) { return static_cast<int>((32 * half + (l % 2) * 16 + row0 + l / 2) * 0x01010101u); };
  return _mm512_set_epi32(b(15), b(14), b(13), b(12), b(11), b(10), b(9), b(8), b(7), b(6), b(5), b(4), b(3), b(2),
                          b(1), b(0));
}

template <int R>
inline void dots(__m512* c, const uint16_t* x, int64_t xs, int64_t k, __m512bh w) {
  UNROLL
  for (int r = 0; r < R; ++r) {
    int32_t pair;
    std::memcpy(&pair, x + r * xs + k, 4);
    c[r] = _mm512_dpbf16_ps(c[r], (__m512bh)_mm512_set1_epi32(pair), w);
  }
}

// What every form shares: P panels' R-row chains over K, started at 0 and stored to acc; block(k0, pb, sc, c) runs
// the 32-k block at k0 (its bytes pb and scales sc per panel) into the chains c[panel][row].
template <int R, int P, typename Block>
__attribute__((always_inline)) inline void chains(const uint8_t* panel, int64_t pstride, float* acc,
                                                  const Block& block) {
  __m512 c[P][R];
  UNROLL
  for (int p = 0; p < P; ++p) UNROLL for (int r = 0; r < R; ++r) c[p][r] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < kK; k0 += 32) {
    const uint8_t* pb[P];
    Scales sc[P];
    block_start<P>(panel, pstride, k0, pb, sc);
    block(k0, pb, sc, c);
  }
  UNROLL
  for (int p = 0; p < P; ++p) UNROLL for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (p * R + r) * 16, c[p][r]);
}

// Today's layout and FastPairs' Q4_1 magic widening (get2 + make).
template <int R, int P>
__attribute__((noinline)) void gemv_vpermb(const uint16_t* x, int64_t xs, const uint8_t* panel, int64_t pstride,
                                           float* acc) {
  const __m512i base = _mm512_set1_epi32(0x40000000), low4 = _mm512_set1_epi8(0x0F);
  const auto q = [&](__m512i idx, __m512i v) {
    return _mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(base, 0x4444444444444444ull, idx, v));
  };
  chains<R, P>(panel, pstride, acc, [&](int64_t k0, const uint8_t* const* pb, const Scales* sc, __m512 (*c)[R]) {
    UNROLL
    for (int j = 0; j < 16; j += 2) {
      UNROLL
      for (int p = 0; p < P; ++p) {
        const __m512i raw = _mm512_loadu_si512(pb[p] + 64 + 2 * (j & 7) * 16);
        const __m512i v = j < 8 ? _mm512_and_si512(raw, low4) : _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        UNROLL
        for (int half = 0; half < 2; ++half)
          dots<R>(c[p], x, xs, k0 + 2 * (j + half), sc[p].pair(q(byte_idx(0, half), v), q(byte_idx(8, half), v)));
      }
    }
  });
}

// FastPairs::get4 (Q4_0 / Q4_1, magic form): pair vectors j and j + 8 from one vpermb per row half; j + 8 held.
template <int R, int P>
__attribute__((noinline)) void gemv_nibbles(const uint16_t* x, int64_t xs, const uint8_t* panel, int64_t pstride,
                                            float* acc) {
  const __m512i base = _mm512_set1_epi32(0x40000000), at16 = _mm512_set1_epi32(0x000F0000);
  const auto flt = [&](__m512i v) { return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(v, at16, base, 0xEA)); };
  chains<R, P>(panel, pstride, acc, [&](int64_t k0, const uint8_t* const* pb, const Scales* sc, __m512 (*c)[R]) {
    __m512bh held[P][8];
    UNROLL
    for (int j = 0; j < 8; j += 2) {
      UNROLL
      for (int p = 0; p < P; ++p) {
        const __m512i raw = _mm512_loadu_si512(pb[p] + 64 + 2 * j * 16);
        UNROLL
        for (int half = 0; half < 2; ++half) {
          const __m512i v0 = _mm512_permutexvar_epi8(byte_idx(0, half), raw);
          const __m512i v1 = _mm512_permutexvar_epi8(byte_idx(8, half), raw);
          held[p][j + half] = sc[p].pair(flt(_mm512_srli_epi32(v0, 4)), flt(_mm512_srli_epi32(v1, 4)));
          dots<R>(c[p], x, xs, k0 + 2 * (j + half), sc[p].pair(flt(v0), flt(v1)));
        }
      }
    }
    UNROLL
    for (int j = 0; j < 8; ++j) UNROLL for (int p = 0; p < P; ++p) dots<R>(c[p], x, xs, k0 + 16 + 2 * j, held[p][j]);
  });
}

// Nibble s of every dword lane at bits 16-19, | 2.0f (Floor: the load itself).
template <int s, bool Floor>
inline __m512 nibble(__m512i v) {
  if constexpr (Floor) return _mm512_castsi512_ps(v);
  __m512i t = v;
  if constexpr (s < 4) t = _mm512_slli_epi32(v, 16 - 4 * s);
  if constexpr (s > 4) t = _mm512_srli_epi32(v, 4 * s - 16);
  return _mm512_castsi512_ps(
      _mm512_ternarylogic_epi32(t, _mm512_set1_epi32(0x000F0000), _mm512_set1_epi32(0x40000000), 0xEA));
}

// The lane-local layout: per block, 4 x 64 bytes [rows 0-7, k 0-15][rows 8-15, k 0-15][rows 0-7, k 16-31][rows 8-15,
// k 16-31]; dword lane l, nibble s: row l / 2 (+ 8), k = 2 s + l % 2 (+ 16).
template <int R, int P, bool Floor>
__attribute__((noinline)) void gemv_lane(const uint16_t* x, int64_t xs, const uint8_t* panel, int64_t pstride,
                                         float* acc) {
  chains<R, P>(panel, pstride, acc, [&](int64_t k0, const uint8_t* const* pb, const Scales* sc, __m512 (*c)[R]) {
    UNROLL
    for (int half = 0; half < 2; ++half) {
      __m512i A[P], B[P];
      UNROLL
      for (int p = 0; p < P; ++p) {
        A[p] = _mm512_loadu_si512(pb[p] + 64 + half * 128);
        B[p] = _mm512_loadu_si512(pb[p] + 64 + half * 128 + 64);
      }
      const auto step = [&]<int s>() {
        UNROLL
        for (int p = 0; p < P; ++p)
          dots<R>(c[p], x, xs, k0 + half * 16 + 2 * s, sc[p].pair(nibble<s, Floor>(A[p]), nibble<s, Floor>(B[p])));
      };
      [&]<int... s>(std::integer_sequence<int, s...>) { (step.template operator()<s>(), ...); }(
          std::make_integer_sequence<int, 8>{});
    }
  });
}

double tsc_per_cycle() {
  const char* e = std::getenv("TSC_PER_CYCLE");
  return e ? std::atof(e) : 0.714;
}

template <int R, int P, typename F>
void run(const char* name, F kernel) {
  const int64_t pstride = (kK / 32) * kBlockBytes;
  std::vector<uint8_t> w(kPanels * pstride);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  for (int64_t p = 0; p < kPanels; ++p)  // finite fp16 scales and mins
    for (int64_t b = 0; b < kK / 32; ++b) {
      uint16_t* h = reinterpret_cast<uint16_t*>(w.data() + p * pstride + b * kBlockBytes);
      for (int i = 0; i < 32; ++i) h[i] = static_cast<uint16_t>(0x2c00 + (i * 37 % 200));
    }
  std::vector<uint16_t> x(R * kK, 0x3f80);
  alignas(64) float acc[R * P * 16];
  double best = 1e30;
  for (int rep = 0; rep < 30; ++rep) {
    const uint64_t t0 = __rdtsc();
    for (int it = 0; it < 200; ++it)
      for (int64_t p = 0; p + P <= kPanels; p += P) kernel(x.data(), kK, w.data() + p * pstride, pstride, acc);
    best = std::min(best, static_cast<double>(__rdtsc() - t0));
  }
  const double pvs = 200.0 * kPanels * (kK / 2);  // pair vectors widened
  std::printf("%-11s R=%d P=%d  %5.2f cycles per pair vector (%4.2f per pair vector and row)\n", name, R, P,
              best / tsc_per_cycle() / pvs, best / tsc_per_cycle() / pvs / R);
}

}  // namespace

int main() {
  run<1, 2>("vpermb", gemv_vpermb<1, 2>);
  run<1, 2>("nibbles", gemv_nibbles<1, 2>);
  run<1, 2>("lane-local", gemv_lane<1, 2, false>);
  run<1, 2>("floor", gemv_lane<1, 2, true>);
  run<1, 1>("vpermb", gemv_vpermb<1, 1>);
  run<1, 1>("lane-local", gemv_lane<1, 1, false>);
  run<1, 4>("vpermb", gemv_vpermb<1, 4>);
  run<1, 4>("nibbles", gemv_nibbles<1, 4>);
  run<1, 4>("lane-local", gemv_lane<1, 4, false>);
  run<2, 2>("vpermb", gemv_vpermb<2, 2>);
  run<2, 2>("nibbles", gemv_nibbles<2, 2>);
  run<2, 2>("lane-local", gemv_lane<2, 2, false>);
  run<2, 2>("floor", gemv_lane<2, 2, true>);
  run<4, 1>("vpermb", gemv_vpermb<4, 1>);
  run<4, 1>("nibbles", gemv_nibbles<4, 1>);
  run<4, 1>("lane-local", gemv_lane<4, 1, false>);
}
