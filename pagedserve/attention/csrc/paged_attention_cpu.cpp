// Decode attention straight from the paged KV cache, on the CPU.
//
// One query token per sequence. Keys and values are read in place through the block table (no
// gathered copy of the context), one (sequence, kv head) pair per task so the K/V rows read once
// serve every query head of the GQA group. Softmax is exact (max-subtracted, float32 accumulation).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
void decode_kernel(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                   int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = H / KVH;
  const int64_t row = KVH * D;              // elements per token slot in a block
  const int64_t block_stride = block_size * row;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH;
      const int64_t S = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      scores.assign(group * S, 0.f);
      const float* qb = q + (b * H + kvh * group) * D;
      for (int64_t j = 0; j < S; ++j) {
        const T* krow = k_cache + table[j / block_size] * block_stride + (j % block_size) * row + kvh * D;
        for (int64_t g = 0; g < group; ++g) {
          const float* qv = qb + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qv[d] * to_f(krow[d]);
          scores[g * S + j] = dot * scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * S;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < S; ++j) m = std::max(m, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < S; ++j) { s[j] = std::exp(s[j] - m); sum += s[j]; }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < S; ++j) s[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < S; ++j) {
        const T* vrow = v_cache + table[j / block_size] * block_stride + (j % block_size) * row + kvh * D;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * S + j];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * to_f(vrow[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (b * H + kvh * group + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d];
      }
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
