// Decode-sized matmuls straight from GGUF quantized blocks (Q8_0, Q4_0, Q4_1), on the CPU.
//
// A GGUF model's weights *are* these blocks: the float32 weights every reference (transformers' GGUF
// loader, gguf-py) computes with are d * q (+ m), exactly. A decode step of a few tokens is bound by
// reading the weights, so reading 4.5-8.5 bits per weight instead of 16 (bf16) or 32 is the win. Each
// block is widened in registers to exactly those float32 weights (the fp16 scale times a small integer
// is exact in float32; Q4_1's + m is one rounding, as in the reference) and multiplied with float32
// activations: the result is the float32 matmul with the dequantized weights, up to summation order.
// (llama.cpp instead quantizes the activations to 8 bits; here they stay exact.)
#include <ATen/Parallel.h>

#include <vector>

#include "common.h"
#include "gguf_layouts.h"

namespace pagedserve {

inline int64_t gguf_block_bytes(int64_t type) { return gguf_layout(type).block_bytes; }

#if defined(PAGEDSERVE_AVX512) && defined(__F16C__)
namespace {

constexpr int64_t kMaxRows = 4;
constexpr int64_t kGgufPrefetchRows = 2;

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 32 weights of one block as two float32 vectors (elements 0-15 and 16-31).
template <int64_t T>
inline void widen_block(const uint8_t* blk, __m512& w0, __m512& w1) {
  if constexpr (T == kQ8_0) {
    const __m512 d = _mm512_set1_ps(half_to_float(blk));
    constexpr int64_t off = gguf_layout(T).quant_offset;
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off + 16));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d);
  } else {
    constexpr int64_t off = gguf_layout(T).quant_offset;
    const float df = half_to_float(blk);
    const __m512 d = _mm512_set1_ps(df);
    // Q4_0: d * (q - 8) = fma(q, d, -8d), exact; Q4_1: fma(q, d, m), one rounding like d * q + m.
    const __m512 m = _mm512_set1_ps(T == kQ4_1 ? half_to_float(blk + gguf_layout(T).min_offset) : -8.f * df);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m);
  }
}

template <int64_t T, int M, typename SY>
void gemv_rows(const float* x, int64_t K, const uint8_t* blocks, int64_t row_bytes, const float* bias, SY* y,
               int64_t N, int64_t n0, int64_t n1) {
  constexpr int64_t bb = gguf_layout(T).block_bytes;
  const int64_t nb = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
    const char* ahead = reinterpret_cast<const char*>(row + kGgufPrefetchRows * row_bytes);
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 w0, w1;
      widen_block<T>(row + b * bb, w0, w1);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * 32;
        acc[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[m]);
        acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[m]);
      if (bias) s += bias[n];
      y[m * N + n] = Elem<SY>::store(s);
    }
  }
}

template <int64_t T, typename SY>
void gemv_dispatch_rows(int64_t M, const float* x, int64_t K, const uint8_t* blocks, int64_t row_bytes,
                        const float* bias, SY* y, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: gemv_rows<T, 1>(x, K, blocks, row_bytes, bias, y, N, n0, n1); break;
      case 2: gemv_rows<T, 2>(x, K, blocks, row_bytes, bias, y, N, n0, n1); break;
      case 3: gemv_rows<T, 3>(x, K, blocks, row_bytes, bias, y, N, n0, n1); break;
      default: gemv_rows<T, 4>(x, K, blocks, row_bytes, bias, y, N, n0, n1); break;
    }
  });
}

}  // namespace

bool has_gguf_gemv() { return true; }

// x: [M, K] float32 or bf16 (M <= 4), blocks: [N, K / 32 * block_bytes] uint8 (one GGUF row per output),
// bias: [N] or None. Returns [M, N] in x's dtype.
torch::Tensor gemv_gguf(torch::Tensor x, torch::Tensor blocks, int64_t type, c10::optional<torch::Tensor> bias) {
  const int64_t bb = gguf_block_bytes(type);
  TORCH_CHECK(bb > 0, "gemv_gguf: unsupported GGUF type id ", type, " (Q4_0, Q4_1 and Q8_0 are)");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows && x.size(1) % 32 == 0,
              "gemv_gguf: x must be [1-4, K] with K a multiple of 32");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == x.size(1) / 32 * bb,
              "gemv_gguf: blocks must be contiguous uint8 [N, K / 32 * ", bb, "]");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  auto xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemv_gguf: bias must have N entries");
    bf = bias->to(torch::kFloat32).contiguous();
  }
  auto y = torch::empty({M, N}, x.options());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const uint8_t* bl = blocks.data_ptr<uint8_t>();
  dispatch_float_bf16(y, "gemv_gguf", [&]<typename SY>() {
    SY* yp = ptr<SY>(y);
    switch (type) {
      case kQ8_0: gemv_dispatch_rows<kQ8_0>(M, xf.data_ptr<float>(), K, bl, blocks.size(1), bp, yp, N); break;
      case kQ4_1: gemv_dispatch_rows<kQ4_1>(M, xf.data_ptr<float>(), K, bl, blocks.size(1), bp, yp, N); break;
      default: gemv_dispatch_rows<kQ4_0>(M, xf.data_ptr<float>(), K, bl, blocks.size(1), bp, yp, N); break;
    }
  });
  return y;
}
#else
bool has_gguf_gemv() { return false; }

torch::Tensor gemv_gguf(torch::Tensor x, torch::Tensor blocks, int64_t type, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(false, "gemv_gguf: this build has no AVX-512");
  return x;
}
#endif


// ---- row-interleaved layout ----------------------------------------------------------------------
// The same blocks regrouped at load time (pagedserve/model/matmul.py: repack_gguf) so that one vector
// lane is one output row: for each group of 16 rows and each block, the j-th quant byte of the 16 rows
// is contiguous (16 bytes), and the 16 rows' fp16 scales (and mins) are contiguous. A GEMV then needs no
// horizontal sums, the activation is a broadcast shared by 16 rows, and the block scale is applied once
// per block: y = sum_b d_b * (sum_j q_j x_j) + m_b * (sum_j x_j) (the same value as the dequantized
// weights' dot product, rounded in another order).
#if defined(PAGEDSERVE_AVX512) && defined(__F16C__)
namespace {

template <int64_t T, int M, typename SY>
void r16_groups(const float* x, const float* xsum, int64_t K, const uint8_t* qs, const uint16_t* dsc,
                const uint16_t* msc, const float* bias, SY* y, int64_t N, int64_t g0, int64_t g1) {
  const int64_t nb = K / 32;
  constexpr int64_t qbytes = gguf_layout(T).quant_bytes * 16;  // quant bytes per (group, block)
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* q = qs + g * nb * qbytes;
    const uint16_t* dg = dsc + g * nb * 16;
    const uint16_t* mg = msc ? msc + g * nb * 16 : nullptr;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, q += qbytes) {
      _mm_prefetch(reinterpret_cast<const char*>(q + 4 * qbytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + 4 * qbytes + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + 4 * qbytes + 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + 4 * qbytes + 192), _MM_HINT_T0);
      // Two independent chains per row of x (even / odd j) so the FMAs overlap.
      __m512 t0[M], t1[M];
      for (int m = 0; m < M; ++m) t0[m] = t1[m] = _mm512_setzero_ps();
      const float* xb = x + b * 32;
      if constexpr (T == kQ8_0) {
        for (int64_t j = 0; j < 32; j += 2) {
          const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + j * 16))));
          const __m512 v1 =
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + j * 16 + 16))));
          for (int m = 0; m < M; ++m) {
            t0[m] = _mm512_fmadd_ps(v0, _mm512_set1_ps(xb[m * K + j]), t0[m]);
            t1[m] = _mm512_fmadd_ps(v1, _mm512_set1_ps(xb[m * K + j + 1]), t1[m]);
          }
        }
      } else {
        for (int64_t j = 0; j < 16; ++j) {
          const __m128i raw = _mm_loadu_si128((const __m128i*)(q + j * 16));
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low)));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low)));
          for (int m = 0; m < M; ++m) {
            t0[m] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[m * K + j]), t0[m]);
            t1[m] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[m * K + j + 16]), t1[m]);
          }
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dg + b * 16)));
      __m512 mins = _mm512_setzero_ps();
      if constexpr (T == kQ4_1) mins = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mg + b * 16)));
      if constexpr (T == kQ4_0) mins = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));  // d * (q - 8)
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_fmadd_ps(d, _mm512_add_ps(t0[m], t1[m]), acc[m]);
        if constexpr (T != kQ8_0) acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xsum[m * nb + b]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      __m512 r = acc[m];
      if (bias) r = _mm512_add_ps(r, _mm512_loadu_ps(bias + g * 16));
      store16(y + m * N + g * 16, r);
    }
  }
}

template <int64_t T, typename SY>
void r16_dispatch(int64_t M, const float* x, const float* xsum, int64_t K, const uint8_t* qs, const uint16_t* d,
                  const uint16_t* mn, const float* bias, SY* y, int64_t N) {
  at::parallel_for(0, N / 16, 4, [&](int64_t g0, int64_t g1) {
    switch (M) {
      case 1: r16_groups<T, 1>(x, xsum, K, qs, d, mn, bias, y, N, g0, g1); break;
      case 2: r16_groups<T, 2>(x, xsum, K, qs, d, mn, bias, y, N, g0, g1); break;
      case 3: r16_groups<T, 3>(x, xsum, K, qs, d, mn, bias, y, N, g0, g1); break;
      default: r16_groups<T, 4>(x, xsum, K, qs, d, mn, bias, y, N, g0, g1); break;
    }
  });
}

}  // namespace

// x: [M, K] (M <= 4); qs: uint8 [N/16, K/32, 16 or 32, 16]; scales, mins: fp16 [N/16, K/32, 16] (mins
// only for Q4_1); bias [N] or None. Returns [M, N] in x's dtype.
torch::Tensor gemv_gguf_r16(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                            int64_t type, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(type == kQ4_0 || type == kQ4_1 || type == kQ8_0, "gemv_gguf_r16: unsupported GGUF type id ", type);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) >= 1 && x.size(0) <= kMaxRows && x.size(1) % 32 == 0,
              "gemv_gguf_r16: x must be [1-4, K] (contiguous rows) with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  const int64_t per = gguf_layout(type).quant_bytes;
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && qs.dim() == 4 && qs.size(1) == nb &&
                  qs.size(2) == per && qs.size(3) == 16,
              "gemv_gguf_r16: qs must be contiguous uint8 [N/16, K/32, ", per, ", 16]");
  const int64_t N = qs.size(0) * 16;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.is_contiguous() && scales.numel() == N / 16 * nb * 16,
              "gemv_gguf_r16: scales must be contiguous fp16 [N/16, K/32, 16]");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins == (type == kQ4_1), "gemv_gguf_r16: mins are given exactly for Q4_1");
  if (has_mins) {
    TORCH_CHECK(mins->scalar_type() == torch::kFloat16 && mins->is_contiguous() && mins->numel() == scales.numel(),
                "gemv_gguf_r16: mins must be shaped like scales");
  }
  // x (and its per-block sums, for the mins) and the bias widened to float32 by hand: at decode sizes a
  // few aten calls would cost as much as the matmul.
  thread_local std::vector<float> xf, xsum, bf;
  xf.resize(M * K);
  xsum.resize(M * nb);
  dispatch_float_bf16(x, "gemv_gguf_r16", [&]<typename SX>() {
    const SX* xp = ptr<SX>(x);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int64_t i = 0; i < 32; ++i) {
          const float v = Elem<SX>::load(xp[m * x.stride(0) + b * 32 + i]);
          xf[m * K + b * 32 + i] = v;
          s += v;
        }
        xsum[m * nb + b] = s;
      }
    }
  });
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == x.scalar_type(),
                "gemv_gguf_r16: bias must be contiguous [N] in x's dtype");
    bf.resize(N);
    dispatch_float_bf16(*bias, "gemv_gguf_r16", [&]<typename SB>() {
      const SB* src = ptr<SB>(*bias);
      for (int64_t n = 0; n < N; ++n) bf[n] = Elem<SB>::load(src[n]);
    });
  }
  auto y = torch::empty({M, N}, x.options());
  const float* bp = has_bias ? bf.data() : nullptr;
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const uint16_t* d = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const uint16_t* mn = has_mins ? reinterpret_cast<const uint16_t*>(mins->data_ptr()) : nullptr;
  dispatch_float_bf16(y, "gemv_gguf_r16", [&]<typename SY>() {
    SY* yp = ptr<SY>(y);
    const float* xp = xf.data();
    const float* sp = xsum.data();
    switch (type) {
      case kQ8_0: r16_dispatch<kQ8_0>(M, xp, sp, K, q, d, mn, bp, yp, N); break;
      case kQ4_1: r16_dispatch<kQ4_1>(M, xp, sp, K, q, d, mn, bp, yp, N); break;
      default: r16_dispatch<kQ4_0>(M, xp, sp, K, q, d, mn, bp, yp, N); break;
    }
  });
  return y;
}
#else
torch::Tensor gemv_gguf_r16(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                            int64_t type, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(false, "gemv_gguf_r16: this build has no AVX-512");
  return x;
}
#endif

}  // namespace pagedserve
