// The register tile of the strict attention (attention.cpp; fixed_gemm.cpp keeps its own copy of the
// same scheme, specialised for packed panels, whose code generation is measured fastest that way): acc[r * as + j] (+)= chain over k of x[r * xs + k] * panel[k * ps + j], for R <= 6 rows
// and 16 columns. Every output is ONE float32 FMA chain over k = 0 .. K-1 in order, so its bits depend
// neither on R nor on the row's place in the tile; with `accumulate` a chain continues from acc (stored
// and reloaded exactly), so splitting k into pieces changes nothing either. AVX2 FMA intrinsics (opaque
// to -ffast-math's reassociation); without them std::fma gives the same correctly rounded steps.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_FIXED_AVX2 1
#endif

namespace pagedserve {
namespace fixed {

constexpr int64_t kNR = 16;  // columns per tile
constexpr int64_t kMR = 6;   // most rows per tile

#ifdef PAGEDSERVE_FIXED_AVX2
inline __m256 wload8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 wload8(const uint16_t* p) {  // bf16 is the top half of a float32
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

// PS > 0: the panel's row stride known at compile time (packed weights: 16), else `ps`. ACC: start from
// acc (a template parameter, so the accumulators stay in registers either way). scale (not ACC): each chain's sum is
// stored times scale (one more rounding: the product a caller would take of the stored sum).
template <int R, typename WT, int64_t PS, bool ACC>
inline void tile(const float* x, int64_t xs, const WT* panel, int64_t ps_, int64_t K,
                 float* acc, int64_t as, float scale = 1.f) {
  const int64_t ps = PS > 0 ? PS : ps_;
  constexpr bool accumulate = ACC;
#ifdef PAGEDSERVE_FIXED_AVX2
  __m256 c0[R], c1[R];
  for (int r = 0; r < R; ++r) {
    if constexpr (accumulate) {
      c0[r] = _mm256_loadu_ps(acc + r * as);
      c1[r] = _mm256_loadu_ps(acc + r * as + 8);
    } else {
      c0[r] = c1[r] = _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = wload8(panel + k * ps), w1 = wload8(panel + k * ps + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * xs + k);
      c0[r] = _mm256_fmadd_ps(a, w0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, w1, c1[r]);
    }
  }
  const __m256 s = _mm256_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    if constexpr (!accumulate) {  // (times 1: the sum itself)
      _mm256_storeu_ps(acc + r * as, _mm256_mul_ps(c0[r], s));
      _mm256_storeu_ps(acc + r * as + 8, _mm256_mul_ps(c1[r], s));
    } else {
      _mm256_storeu_ps(acc + r * as, c0[r]);
      _mm256_storeu_ps(acc + r * as + 8, c1[r]);
    }
  }
#else
  if constexpr (!accumulate)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kNR; ++j) acc[r * as + j] = 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kNR; ++j)
        acc[r * as + j] = std::fma(x[r * xs + k], Elem<WT>::load(panel[k * ps + j]), acc[r * as + j]);
  if constexpr (!accumulate)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kNR; ++j) acc[r * as + j] *= scale;
#endif
}

template <typename WT, int64_t PS, bool ACC>
inline void tile_rows(int64_t R, const float* x, int64_t xs, const WT* panel, int64_t ps, int64_t K, float* acc,
                      int64_t as, float scale = 1.f) {
  switch (R) {
    case 1: tile<1, WT, PS, ACC>(x, xs, panel, ps, K, acc, as, scale); break;
    case 2: tile<2, WT, PS, ACC>(x, xs, panel, ps, K, acc, as, scale); break;
    case 3: tile<3, WT, PS, ACC>(x, xs, panel, ps, K, acc, as, scale); break;
    case 4: tile<4, WT, PS, ACC>(x, xs, panel, ps, K, acc, as, scale); break;
    case 5: tile<5, WT, PS, ACC>(x, xs, panel, ps, K, acc, as, scale); break;
    default: tile<6, WT, PS, ACC>(x, xs, panel, ps, K, acc, as, scale); break;
  }
}

// acc[d] = fma(p, v[d], acc[d]) for d < n: one more step of n chains (the same step a tile takes).
template <typename WT>
inline void axpy_step(float p, const WT* v, float* acc, int64_t n) {
  int64_t d = 0;
#ifdef PAGEDSERVE_FIXED_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, wload8(v + d), _mm256_loadu_ps(acc + d)));
#endif
  for (; d < n; ++d) acc[d] = std::fma(p, Elem<WT>::load(v[d]), acc[d]);
}

}  // namespace fixed
}  // namespace pagedserve
