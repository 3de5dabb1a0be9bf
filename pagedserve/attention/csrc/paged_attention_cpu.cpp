// Decode attention straight from the paged KV cache, on the CPU.
//
// One query token per sequence. Keys and values are read in place through the block table (no
// gathered copy of the context), one (sequence, kv head) pair per task so the K/V rows read once
// serve every query head of the GQA group. Softmax is exact (max-subtracted, float32 accumulation).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

#ifdef __AVX2__
#include <immintrin.h>
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
constexpr int64_t kMaxGroup = 8;
#endif

// scores[g * S + j] = q_g · k_j for every query head g of the group: the K row is loaded once for all
// of them, and the group's dot products run as independent FMA chains.
template <typename T>
inline void group_dots(const float* qb, const T* krow, int64_t group, int64_t D, float scale, float* out,
                       int64_t stride) {
#ifdef __AVX2__
  if (D % 8 == 0 && group <= kMaxGroup) {
    __m256 acc[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kv = load8(krow + d);
      for (int64_t g = 0; g < group; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + g * D + d), kv, acc[g]);
    }
    for (int64_t g = 0; g < group; ++g) out[g * stride] = hsum8(acc[g]) * scale;
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g) {
    const float* qv = qb + g * D;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += qv[d] * to_f(krow[d]);
    out[g * stride] = dot * scale;
  }
}

template <typename T>
void decode_kernel(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                   int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = H / KVH;
  const int64_t row = KVH * D;              // elements per token slot in a block
  const int64_t block_stride = block_size * row;
  // One task per sequence: each token's K (and V) row of all kv heads is read once, contiguously.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(H * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t S = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      scores.resize(H * S);
      const float* qb = q + b * H * D;
      // Walk the block table block by block (no division per token); head h's scores are row h.
      for (int64_t j0 = 0; j0 < S; j0 += block_size) {
        const T* base = k_cache + table[j0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, S - j0);
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t kvh = 0; kvh < KVH; ++kvh) {
            group_dots(qb + kvh * group * D, base + t * row + kvh * D, group, D, scale,
                       scores.data() + kvh * group * S + j0 + t, S);
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        // Start from a real score, not -inf: the kernel is built with -ffast-math (vector expf).
        float* sc = scores.data() + h * S;
        float m = sc[0];
        for (int64_t j = 1; j < S; ++j) m = std::max(m, sc[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < S; ++j) {
          sc[j] = expf(sc[j] - m);
          sum += sc[j];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = 0; j < S; ++j) sc[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; j0 < S; j0 += block_size) {
        const T* base = v_cache + table[j0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, S - j0);
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t h = 0; h < H; ++h) {
            const T* vrow = base + t * row + (h / group) * D;
            const float p = scores[h * S + j0 + t];
            float* a = acc.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * to_f(vrow[d]);
          }
        }
      }
      std::copy(acc.begin(), acc.end(), out + b * H * D);
    }
  });
}

}  // namespace

// q: [B, H, D] (any float dtype), caches: [num_blocks, block_size, KVH, D] float32 or bfloat16,
// block_tables: [B, max_blocks] int64, seq_lens: [B] int64. Returns [B, H, D] in q's dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto qf = q.to(torch::kFloat32).contiguous();
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto sl = seq_lens.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D, "head shapes do not match");
  auto out = torch::empty({B, H, D}, qf.options());
  if (k_cache.scalar_type() == torch::kFloat32) {
    decode_kernel<float>(qf.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D,
                         block_size, bt.size(1), static_cast<float>(scale));
  } else if (k_cache.scalar_type() == torch::kBFloat16) {
    decode_kernel<c10::BFloat16>(qf.data_ptr<float>(), k_cache.data_ptr<c10::BFloat16>(),
                                 v_cache.data_ptr<c10::BFloat16>(), bt.data_ptr<int64_t>(),
                                 sl.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D, block_size,
                                 bt.size(1), static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "paged_decode_attention: cache dtype must be float32 or bfloat16");
  }
  return out.to(q.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache");
}
