// Shared helpers of pagedserve's CPU kernels: element loads/stores for float32 and bfloat16 storage.
//
// bf16 is handled as its raw 16 bits (uint16_t) so that plain loops vectorize: a bf16 value is the top
// half of a float32, and rounding back is round-to-nearest-even on the dropped half (as PyTorch does).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_AVX512 1
#endif

namespace pagedserve {

template <typename S>
struct Elem;

template <>
struct Elem<float> {
  static inline float load(float x) { return x; }
  static inline float store(float x) { return x; }
};

template <>
struct Elem<uint16_t> {
  static inline float load(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

// x rounded to the storage precision and widened back (identity for float32).
template <typename S>
inline float round_to(float x) {
  return Elem<S>::load(Elem<S>::store(x));
}

template <typename S>
inline S* ptr(const torch::Tensor& t) {
  return reinterpret_cast<S*>(t.data_ptr());
}

// Runs body.template operator()<S>() with S = float or uint16_t (bf16 bits) by the tensor's dtype.
template <typename F>
inline void dispatch_float_bf16(const torch::Tensor& t, const char* what, F&& body) {
  if (t.scalar_type() == torch::kFloat32) {
    body.template operator()<float>();
  } else if (t.scalar_type() == torch::kBFloat16) {
    body.template operator()<uint16_t>();
  } else {
    TORCH_CHECK(false, what, ": dtype must be float32 or bfloat16, got ", t.scalar_type());
  }
}

#ifdef PAGEDSERVE_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {  // round to nearest even, as Elem<uint16_t>::store
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
#endif

}  // namespace pagedserve
