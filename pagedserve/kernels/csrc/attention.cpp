// Decode attention straight from the paged KV cache, on the CPU.
//
// One query token per sequence. Keys and values are read in place through the block table (no
// gathered copy of the context). A task is one (sequence, kv head, group of up to 8 query heads): each
// K/V row it reads serves every query head of the GQA group. Softmax is exact (max-subtracted, float32). A sliding
// window (Gemma's, Mistral's) limits each sequence to its last `window` keys (window_span below).
//
// With AVX-512 the query heads' dot products and the V accumulation stay in registers (templated on the
// group size); with AVX512-BF16, a bf16 cache and query run the scores as pair dot products and P.V over key pairs
// (the probabilities rounded to bf16, as the prefill row kernel does); without AVX-512 (AVX2 or older CPUs) the
// portable `legacy` kernel runs.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "common.h"
#include "fixed_tile.h"
#include "ops.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedserve {

// Exact softmax of S scores in place, max-subtracted, float32; stats (if given) gets the max and the sum of the
// exponentials.
inline void softmax_inplace(float* r, int64_t S, float* stats = nullptr) {
  float m = r[0];  // a real score, not -inf: the kernels are built with -ffast-math (vector expf)
  for (int64_t j = 1; j < S; ++j) m = std::max(m, r[j]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < S; ++j) {
    r[j] = expf(r[j] - m);
    sum += r[j];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t j = 0; j < S; ++j) r[j] *= inv;
  if (stats) {
    stats[0] = m;
    stats[1] = sum;
  }
}

// A sliding window (window > 0): a sequence of S keys sees keys S - window .. S - 1 only. The decode kernels start
// at the cache block holding the first of them (block table and S shifted by whole blocks, so every block-aligned
// step of theirs stays aligned) and give the `skip` keys before it in that block a score far below any real one
// (finite: the kernels are built with -ffast-math), whose exponential is 0: no weight in the softmax or in P.V.
struct WindowSpan {
  const int64_t* table;
  int64_t S, skip;
};
inline WindowSpan window_span(const int64_t* table, int64_t S, int64_t BS, int64_t window) {
  if (window <= 0 || S <= window) return {table, S, 0};
  const int64_t first = S - window, start = first / BS * BS;
  return {table + start / BS, S - start, first - start};
}
// The first key a row with ctx keys of context sees through a window (window > 0; 0: every key) — the prefill row
// kernels' per-row window.
inline int64_t window_first(int64_t ctx, int64_t window) { return window > 0 ? std::max<int64_t>(0, ctx - window) : 0; }
constexpr float kMaskedScore = -1e30f;
// Rows of S scores (row stride S) of n heads: the first skip masked.
inline void mask_skipped(float* sc, int64_t n, int64_t S, int64_t skip) {
  for (int64_t h = 0; h < n; ++h) std::fill(sc + h * S, sc + h * S + skip, kMaskedScore);
}

// The K and V rows of one (sequence, partition) of decode attention — the byte range [o0, o1) of each row, the kv
// heads a thread attends there — asked into L2 a cache line (of K and of V) at a time. A thread of decode_avx512
// attends its tasks in order and streams the next pair's rows while it computes this one's: the scores and P.V
// passes call step() as they go, with their work since the last call in units (e.g. 8 per 32 keys' scores on tiles),
// and the stream spreads the next pair's lines evenly over this pair's units (pace: as many as the last pair used,
// scaled by the two pairs' keys); what is left when the next pair starts is asked for at once (finish). Asked for a
// fixed 1 line per unit, W1's pairs (192 keys) left 37% of their next pair's lines to that burst, which stalls on
// the line-fill buffers: paced, W1's decode attention took 1.147 -> 1.083 ms per layer (0.94x). The blocks lie at
// random places, where no hardware prefetcher follows; a pair's rows (~150 KB for SmolLM2 at 192 keys) fit L2
// beside the next one's. On a Sapphire Rapids the stream took W1's decode attention from 1.9 to 1.05 ms per layer
// (benchmarks/decode_attention_ab.py), where prefetching a fixed distance ahead inside each task (kept in flight by
// too few line-fill buffers) overlapped little of the memory with the compute. A thread's first pair is not asked for ahead (`cold`): its passes prefetch their own rows a fixed
// distance ahead (prefetch_ahead), which overlaps better where a thread has a single pair (one sequence's decode).
// The AVX2 kernel (legacy::decode_kernel) streams each thread's next sequence's rows (of its kv heads there) the
// same way.
struct RowStream {
  bool cold = true;
  const char* kc = nullptr;
  const char* vc = nullptr;
  const int64_t* table = nullptr;  // the block of the next row
  int64_t left = 0, BS = 1, rowb = 0, o0 = 0, o1 = 0, jb = 0, o = 0, at = 0;  // at: the next row's byte offset

  void start(const void* k, const void* v, const int64_t* t, int64_t keys, int64_t bs, int64_t row_bytes,
             int64_t first_byte, int64_t end_byte) {
    kc = static_cast<const char*>(k);
    vc = static_cast<const char*>(v);
    table = t;
    left = keys;
    BS = bs;
    rowb = row_bytes;
    o0 = o = first_byte / 64 * 64;
    o1 = end_byte;
    jb = 0;
    at = keys > 0 ? table[0] * BS * rowb : 0;
  }
  void stop() { left = 0; }
  // Paced (decode_avx512): the passes report their work in units (step's argument), and each unit asks for
  // rate / 65536 lines (the fraction carried in acc), so that the next pair's rows are asked for evenly over this
  // pair's whole compute; rate 0 (a cold pair, or a stream no one paced): a line per unit. `used` counts the units.
  int64_t rate = 0, acc = 0, used = 0;
  // Spread what is left over `units` units of work (0: unpaced); the unit count starts again.
  void pace(int64_t units) {
    const int64_t need = lines_left();
    rate = units > 0 ? std::max<int64_t>(1, (need << 16) / units) : 0;
    acc = used = 0;
  }
  // Unpaced (decode_kernel): lines per unit so that `units` units ask for all that is left (at least 1).
  int64_t per_unit(int64_t units) const {
    return std::max<int64_t>(1, (lines_left() + units - 1) / std::max<int64_t>(1, units));
  }
  int64_t lines_left() const { return (o1 - o0 + 63) / 64 * left; }
  inline void step(int64_t units) {
    used += units;
    int64_t lines = units;
    if (rate > 0) {
      acc += units * rate;
      lines = acc >> 16;
      acc -= lines << 16;
    }
    issue(lines);
  }
  void finish() { issue(INT64_MAX); }

 private:
  inline void issue(int64_t lines) {
    for (; lines > 0 && left > 0; --lines) {
      __builtin_prefetch(kc + at + o, 0, 2);  // prefetcht1
      __builtin_prefetch(vc + at + o, 0, 2);
      o += 64;
      if (o >= o1) {
        o = o0;
        if (--left == 0) break;
        if (++jb == BS) {
          jb = 0;
          ++table;
        }
        at = (table[0] * BS + jb) * rowb;
      }
    }
  }
};

namespace legacy {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

#ifdef __AVX2__
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
// Head sizes decode_kernel's AVX2 passes take (its route; the decode team's check, decode_attention_in_team).
inline bool decode_heads_take(int64_t D) { return D % 8 == 0; }
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

#ifdef __AVX2__
// Lane t = hsum8(a[t]) for t < 8: the same additions in the same order (v_i + v_i+4, then lanes 0 + 2 and 1 + 3,
// then those two), eight keys' at once.
inline __m256 hsum8x8(const __m256* a) {
  __m256 s[4];
  for (int t = 0; t < 4; ++t)
    s[t] = _mm256_add_ps(_mm256_permute2f128_ps(a[t], a[t + 4], 0x20), _mm256_permute2f128_ps(a[t], a[t + 4], 0x31));
  const __m256 r01 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 r23 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(r01, r23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(r01, r23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The legacy kernel's passes for D % 8 == 0, the same bits as group_dots and the key-by-key P.V: scores of a head
// eight keys at a time (eight FMA chains over d, then hsum8x8); P.V of G <= 3 heads of one kv head over 8 * NV of
// their d, accumulated in registers key by key (the same FMA chain per output as `a[d] += p * v[d]`).
// legacy_scores: the G query heads of one kv head (q rows at qg, G * D; head g's scores at out + g * S), per 8 keys
// their row pointers once (one table lookup where the 8 keys share a block, as they do for any block size divisible
// by 8), then each head's 8 dots while the 8 K rows stay in L1 (per head and key, a division and a lookup had cost
// about as much as the dot product on a Zen 3).
// (os: the score rows' stride, S where a call covers all of a sequence's keys.)
template <typename T>
void legacy_scores(const float* qg, int64_t G, const T* kc, const int64_t* table, int64_t S, int64_t BS,
                   int64_t block_stride, int64_t row, int64_t D, float scale, float* out, RowStream& ahead, int64_t per,
                   int64_t os) {
  const __m256 sv = _mm256_set1_ps(scale);
  int64_t j0 = 0;
  for (; j0 + 8 <= S; j0 += 8) {
    const T* kr[8];
    if (BS % 8 == 0) {
      const T* k0 = kc + table[j0 / BS] * block_stride + (j0 % BS) * row;
      for (int t = 0; t < 8; ++t) kr[t] = k0 + t * row;
    } else {
      for (int t = 0; t < 8; ++t) kr[t] = kc + table[(j0 + t) / BS] * block_stride + ((j0 + t) % BS) * row;
    }
    for (int64_t g = 0; g < G; ++g) {
      ahead.step(per);
      const float* qh = qg + g * D;
      __m256 a[8];
      for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + d);
        for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, load8(kr[t] + d), a[t]);
      }
      _mm256_storeu_ps(out + g * os + j0, _mm256_mul_ps(hsum8x8(a), sv));
    }
  }
  for (; j0 < S; ++j0) {
    const T* k = kc + table[j0 / BS] * block_stride + (j0 % BS) * row;
    for (int64_t g = 0; g < G; ++g) {
      ahead.step(per);
      const float* qh = qg + g * D;
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(k + d), a);
      out[g * os + j0] = hsum8(a) * scale;
    }
  }
}

template <typename T, int G, int NV>
void legacy_pv(const float* p, int64_t S, const T* vc, const int64_t* table, int64_t BS, int64_t block_stride,
               int64_t row, int64_t D, float* o, RowStream& ahead, int64_t per) {
  __m256 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < S; j0 += BS) {
    const T* base = vc + table[j0 / BS] * block_stride;
    const int64_t n = std::min(BS, S - j0);
    for (int64_t t = 0; t < n; ++t) {
      if (t % 4 == 0) ahead.step(std::min<int64_t>(4, n - t) * per);
      __m256 v[NV];
      for (int c = 0; c < NV; ++c) v[c] = load8(base + t * row + 8 * c);
      for (int g = 0; g < G; ++g) {
        const __m256 pv = _mm256_set1_ps(p[g * S + j0 + t]);
        for (int c = 0; c < NV; ++c) acc[g][c] = _mm256_fmadd_ps(pv, v[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o + g * D + 8 * c, acc[g][c]);
}

template <typename T, int G>
void legacy_pv_g(int nv, const float* p, int64_t S, const T* vc, const int64_t* table, int64_t BS,
                 int64_t block_stride, int64_t row, int64_t D, float* o, RowStream& ahead, int64_t per) {
  switch (nv) {
    case 1: legacy_pv<T, G, 1>(p, S, vc, table, BS, block_stride, row, D, o, ahead, per); break;
    case 2: legacy_pv<T, G, 2>(p, S, vc, table, BS, block_stride, row, D, o, ahead, per); break;
    case 3: legacy_pv<T, G, 3>(p, S, vc, table, BS, block_stride, row, D, o, ahead, per); break;
    default: legacy_pv<T, G, 4>(p, S, vc, table, BS, block_stride, row, D, o, ahead, per); break;
  }
}

// One P.V pass: min(3, heads) heads (their probabilities at p, row stride S) over the 32-d pass at vc / o.
template <typename T>
inline void legacy_pv_pass(int64_t heads, int64_t D, int64_t c0, const float* p, int64_t S, const T* vc,
                           const int64_t* table, int64_t BS, int64_t block_stride, int64_t row, float* o,
                           RowStream& ahead, int64_t per) {
  const int nv = static_cast<int>(std::min<int64_t>(4, (D - c0) / 8));
  switch (std::min<int64_t>(3, heads)) {
    case 1: legacy_pv_g<T, 1>(nv, p, S, vc, table, BS, block_stride, row, D, o, ahead, per); break;
    case 2: legacy_pv_g<T, 2>(nv, p, S, vc, table, BS, block_stride, row, D, o, ahead, per); break;
    default: legacy_pv_g<T, 3>(nv, p, S, vc, table, BS, block_stride, row, D, o, ahead, per); break;
  }
}
#endif

#ifdef __AVX2__
// decode_kernel's register passes for a decode team whose (sequence, kv head) pairs do not split evenly between its
// threads (one sequence of Gemma 3's single kv head, or of SmolLM2's three, on 2 threads: one thread had attended a
// whole pair more while the other waited). Here every pass splits: the scores by 64-key chunks of each pair, the
// softmax by query head, P.V by its (up to 3 heads, 32-d) passes, the team meeting between them, the scores in the
// team's scratch. Each score, softmax and P.V output is the chain the one-pass form computes (a key's score is the
// same whichever 8 keys legacy_scores takes it with), so the same bits. No stream ahead (the team attends one step's
// rows only).
template <typename T, typename SpanOf>
void decode_phased(const float* q, int64_t q_stride, const int64_t* rows, const T* k_cache, const T* v_cache,
                   int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, const SpanOf& span_of, float scale,
                   float* out) {
  constexpr int64_t kChunk = 64;
  const int64_t G = H / KVH, row = KVH * D, block_stride = BS * row, P = B * KVH;
  const int64_t chunk = BS * std::max<int64_t>(1, kChunk / BS);  // whole blocks
  std::vector<int64_t> first(P + 1, 0), units(P + 1, 0);  // per pair: its scores' offset, its chunks before it
  std::vector<WindowSpan> spans(B);
  for (int64_t b = 0; b < B; ++b) spans[b] = span_of(b);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t S = spans[p / KVH].S;
    first[p + 1] = first[p] + G * S;
    units[p + 1] = units[p] + (S + chunk - 1) / chunk;
  }
  std::vector<float>& sc = *g_team.scratch;
  if (g_team.t == 0) sc.resize(first[P]);
  team_sync();
  RowStream none;
  none.stop();
  const auto pair_of = [&](int64_t u) {  // the pair of scores chunk u
    return static_cast<int64_t>(std::upper_bound(units.begin(), units.end(), u) - units.begin()) - 1;
  };
  team_for(units[P], 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p = pair_of(u), b = p / KVH, kvh = p % KVH, j0 = (u - units[p]) * chunk;
      const WindowSpan& sp = spans[b];
      const int64_t r = rows ? rows[b] : b;
      legacy_scores(q + r * q_stride + kvh * G * D, G, k_cache + kvh * D, sp.table + j0 / BS,
                    std::min(chunk, sp.S - j0), BS, block_stride, row, D, scale, sc.data() + first[p] + j0, none, 1,
                    sp.S);
    }
  });
  team_sync();
  team_for(P * G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const WindowSpan& sp = spans[i / G / KVH];
      float* r = sc.data() + first[i / G] + (i % G) * sp.S;
      mask_skipped(r, 1, sp.S, sp.skip);
      softmax_inplace(r, sp.S);
    }
  });
  team_sync();
  const int64_t groups = (G + 2) / 3, passes = (D + 31) / 32;
  team_for(P * groups * passes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / (groups * passes), gi = i / passes % groups * 3, c0 = i % passes * 32;
      const int64_t b = p / KVH, kvh = p % KVH, r = rows ? rows[b] : b, h0 = kvh * G + gi;
      const WindowSpan& sp = spans[b];
      legacy_pv_pass(G - gi, D, c0, sc.data() + first[p] + gi * sp.S, sp.S, v_cache + kvh * D + c0, sp.table, BS,
                     block_stride, row, out + (r * H + h0) * D + c0, none, 1);
    }
  });
}
#endif

// q: rows of H * D float32 (row r at q + r * q_stride; sequence b's is rows[b], or b where rows is null), out: the same
// rows of [T, H, D].
template <typename T>
void decode_kernel(const float* q, int64_t q_stride, const int64_t* rows, const T* k_cache, const T* v_cache,
                   const int64_t* block_tables, const int64_t* seq_lens, float* out, int64_t B, int64_t H, int64_t KVH,
                   int64_t D, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = H / KVH;
  const int64_t row = KVH * D;              // elements per token slot in a block
  const int64_t block_stride = block_size * row;
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(T));
  auto span_of = [&](int64_t b) {
    return window_span(block_tables + b * max_blocks, seq_lens[b], block_size, window);
  };
#ifdef __AVX2__
  if (decode_heads_take(D)) {
    // The register passes (legacy_scores, legacy_pv). Tasks are (sequence, kv head) pairs in order, split between the
    // threads (team_for: a decode team's member runs its share; at a step of one sequence its kv heads split). A thread
    // streams the next sequence's rows (of the kv heads it attends there) into L2 while it attends this one's
    // (RowStream: steps spread over the passes of its tasks, what is left asked for when the next sequence starts).
    if (g_team.t >= 0 && g_team.barrier && g_team.scratch && B * KVH % g_team.n != 0 && B * KVH < 2 * g_team.n) {
      decode_phased(q, q_stride, rows, k_cache, v_cache, B, H, KVH, D, block_size, span_of, scale, out);
      return;
    }
    const int64_t eb = D * static_cast<int64_t>(sizeof(T));
    // One (sequence, kv head) pair: its scores, softmax and P.V, `per` lines of `ahead` per step.
    const auto attend = [&](int64_t item, std::vector<float>& scores, RowStream& ahead, int64_t per) {
      const int64_t b = item / KVH, kvh = item % KVH;
      const WindowSpan span = span_of(b);
      const int64_t S = span.S;
      scores.resize(group * S);
      const int64_t r = rows ? rows[b] : b, h0 = kvh * group;
      legacy_scores(q + r * q_stride + h0 * D, group, k_cache + kvh * D, span.table, S, block_size, block_stride, row,
                    D, scale, scores.data(), ahead, per, S);
      mask_skipped(scores.data(), group, S, span.skip);
      for (int64_t g = 0; g < group; ++g) softmax_inplace(scores.data() + g * S, S);
      for (int64_t gi = 0; gi < group; gi += 3) {
        for (int64_t c0 = 0; c0 < D; c0 += 32)
          legacy_pv_pass(group - gi, D, c0, scores.data() + gi * S, S, v_cache + kvh * D + c0, span.table, block_size,
                         block_stride, row, out + (r * H + h0 + gi) * D + c0, ahead, per);
      }
    };
    // The steps of pair `item` (`per` lines each; legacy_scores: one per head and 8 keys or a last key, legacy_pv: one
    // per key of each 32-d pass of up to 3 heads).
    const auto steps = [&](int64_t item) {
      const int64_t S = span_of(item / KVH).S;
      return group * (S / 8 + S % 8) + (group + 2) / 3 * ((D + 31) / 32) * S;
    };
    if (g_team.t < 0 && B >= 4 * at::get_num_threads()) {
      // Many sequences outside a team: each goes to whichever thread is free (parallel_claims: a slower core takes
      // fewer). A thread claims its next sequence before it attends this one, and streams that sequence's rows (all of
      // their kv heads: whole rows, as a static share of the pairs does; per pair, its D values of each row, it read
      // 1.3x slower from memory) over this one's steps; what is left is asked for when the next one starts.
      parallel_claims(B, [&](const auto& next) {
        std::vector<float> scores;
        RowStream ahead;
        for (int64_t b = next(); b >= 0;) {
          const int64_t following = next();
          ahead.finish();
          if (following >= 0) {
            const WindowSpan span = span_of(following);
            ahead.start(k_cache, v_cache, span.table, span.S, block_size, row_bytes, 0, KVH * eb);
          } else {
            ahead.stop();
          }
          const int64_t per = ahead.per_unit(KVH * steps(b * KVH));
          for (int64_t kvh = 0; kvh < KVH; ++kvh) attend(b * KVH + kvh, scores, ahead, per);
          b = following;
        }
      });
      return;
    }
    // Else (a decode team's member, or few sequences) a share of the pairs, in order (at one sequence its kv heads
    // split). A thread streams the next sequence's rows (of the kv heads it attends there) over this sequence's steps
    // here.
    team_for(B * KVH, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      RowStream ahead;
      int64_t per = 1;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / KVH, kvh = item % KVH;
        if (item == begin || kvh == 0) {  // a new sequence: stream the next one's rows (of its tasks here)
          ahead.finish();
          const int64_t next0 = (b + 1) * KVH, next1 = std::min(end, next0 + KVH);
          if (next0 < end) {
            const WindowSpan next = span_of(b + 1);
            ahead.start(k_cache, v_cache, next.table, next.S, block_size, row_bytes, 0, (next1 - next0) * eb);
          } else {
            ahead.stop();
          }
          per = ahead.per_unit((std::min(end, next0) - item) * steps(item));
        }
        attend(item, scores, ahead, per);
      }
    });
    return;
  }
#endif
  // One task per sequence: each token's K (and V) row of all kv heads is read once, contiguously.
  // Each thread streams the next sequence's K and V rows into L2 while it attends this one (RowStream): steps
  // spread over both passes, what is left asked for when the next sequence starts.
  const int64_t lines = (row_bytes + 63) / 64;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(H * D);
    RowStream ahead;
    for (int64_t b = begin; b < end; ++b) {
      const WindowSpan span = span_of(b);
      const int64_t S = span.S;
      const int64_t* table = span.table;
      ahead.finish();
      if (b + 1 < end) {
        const WindowSpan next = span_of(b + 1);
        ahead.start(k_cache, v_cache, next.table, next.S, block_size, row_bytes, 0, row_bytes);
      } else {
        ahead.stop();
      }
      const float* qb = q + (rows ? rows[b] : b) * q_stride;
      scores.resize(H * S);
      // lines per key of each pass: the next sequence's rows (its S' keys x lines) over this one's 2 S key visits
      const int64_t per_key = std::max<int64_t>(1, (ahead.left * lines + 2 * S - 1) / std::max<int64_t>(1, 2 * S));
      // Walk the block table block by block (no division per token); head h's scores are row h.
      for (int64_t j0 = 0; j0 < S; j0 += block_size) {
        const T* base = k_cache + table[j0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, S - j0);
        for (int64_t t = 0; t < n; ++t) {
          ahead.step(per_key);
          for (int64_t kvh = 0; kvh < KVH; ++kvh) {
            group_dots(qb + kvh * group * D, base + t * row + kvh * D, group, D, scale,
                       scores.data() + kvh * group * S + j0 + t, S);
          }
        }
      }
      mask_skipped(scores.data(), H, S, span.skip);
      for (int64_t h = 0; h < H; ++h) softmax_inplace(scores.data() + h * S, S);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; j0 < S; j0 += block_size) {
        const T* base = v_cache + table[j0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, S - j0);
        for (int64_t t = 0; t < n; ++t) {
          ahead.step(per_key);
          for (int64_t h = 0; h < H; ++h) {
            const T* vrow = base + t * row + (h / group) * D;
            const float p = scores[h * S + j0 + t];
            float* a = acc.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * to_f(vrow[d]);
          }
        }
      }
      std::copy(acc.begin(), acc.end(), out + (rows ? rows[b] : b) * H * D);
    }
  });
}

}  // namespace legacy
}  // namespace pagedserve


namespace pagedserve {
namespace strict {

// The strict mode's attention (batch_invariant): every query row, prefill or decode, attends over its
// own context (its position + 1 keys) with an order that depends on nothing else: for each key, the
// GQA group's dots (8-lane FMA chains over d, then one fixed horizontal sum), an exact float32 softmax
// over the row's scores, then the V rows accumulated key by key. Rows of one sequence are processed in
// tiles that share each K/V row they read (a prompt's rows read the same keys), but each row's
// arithmetic is the same whatever tile it is in, so a row's output is the same bits alone, in a batch,
// in any chunk of its prompt, or recomputed after a preemption.
constexpr int64_t kRowTile = 8;
constexpr int64_t kAlignFloats = 16;  // score rows start 64-byte aligned: the same code path for every row


// The tiled version for head_dim % 16 == 0: both matmuls of attention run fixed::tile, so each score is
// one FMA chain over d and each output element one FMA chain over the keys in order (the tile's rows
// share every K/V load). Keys a row does not see are never part of its chains: the keys every row of the
// tile sees go through tiles, each row's few extra keys through axpy_step (the same FMA step).
constexpr int64_t kTileRows = 12;

// Keys j0 .. j0 + n - 1 (n <= 16) of kv head kvh, through a sequence's block table, transposed into kT [D][16]
// (zeros in the columns past n).
template <typename S>
inline void transpose_keys(const S* k_cache, const int64_t* table, int64_t BS, int64_t block_stride, int64_t row,
                           int64_t kvh, int64_t D, int64_t j0, int64_t n, float* kT) {
  using fixed::kNR;
  for (int64_t t = 0; t < kNR; ++t) {
    const int64_t j = j0 + t;
    if (t < n) {
      const S* krow = k_cache + table[j / BS] * block_stride + (j % BS) * row + kvh * D;
      for (int64_t d = 0; d < D; ++d) kT[d * kNR + t] = Elem<S>::load(krow[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) kT[d * kNR + t] = 0.f;
    }
  }
}

// q: row r at q + rw[r] * qs (rw null: r), heads contiguous; out: row r at out + rw[r] * H * D (contiguous rows), so a
// step's prefill rows are read in place from the qkv projection and written among its decode rows with no copies.
template <typename S>
void rows_kernel_tiled(const float* q, int64_t qs, const int64_t* rw, const S* k_cache, const S* v_cache,
                       const int64_t* block_tables, const int64_t* seq_lens, const int64_t* qsl, float* out, int64_t B,
                       int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t W, float scale, int64_t window) {
  using fixed::kMR;
  using fixed::kNR;
  const int64_t group = H / KVH, row = KVH * D, block_stride = BS * row;
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = qsl[b]; r < qsl[b + 1]; r += kTileRows) items.emplace_back(b, r);
  // Each sequence's keys transposed once per call, kall + koff[b]: [kvh][16-key chunk][D][16] (zeros past its last
  // key), shared by all its row tiles (a 1,024-row prompt's 86 tiles each transposed every key they see before:
  // scalar moves ~ a fifth of the score tiles' work). The same floats in the same kT layout, so the same bits; past a
  // budget (long contexts) each tile transposes its own keys as before.
  std::vector<int64_t> nch(B), koff(B + 1, 0), coff(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    nch[b] = (seq_lens[b] + kNR - 1) / kNR;
    coff[b + 1] = coff[b] + KVH * nch[b];
    koff[b + 1] = coff[b + 1] * D * kNR;
  }
  constexpr int64_t kSharedKFloats = int64_t{16} << 20;  // 64 MB
  std::unique_ptr<float[]> kall_buf;
  float* kall = nullptr;
  if (koff[B] <= kSharedKFloats) {
    kall_buf.reset(new float[koff[B] + 16]);
    kall = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(kall_buf.get()) + 63) & ~uintptr_t{63});
    at::parallel_for(0, coff[B], 16, [&](int64_t c0, int64_t c1) {
      int64_t b = std::upper_bound(coff.begin(), coff.end(), c0) - coff.begin() - 1;
      for (int64_t c = c0; c < c1; ++c) {
        while (c >= coff[b + 1]) ++b;
        const int64_t kvh = (c - coff[b]) / nch[b], j0 = (c - coff[b]) % nch[b] * kNR;
        const int64_t n = std::min(kNR, seq_lens[b] - j0);
        transpose_keys(k_cache, block_tables + b * W, BS, block_stride, row, kvh, D, j0, n, kall + c * D * kNR);
      }
    });
  }
  // Tiles go to whichever thread is free (parallel_claims), the last (the most keys) first, so that neither a slower
  // core nor a causal prompt's costlier late tiles leave a thread waiting at the end.
  const int64_t n_items = static_cast<int64_t>(items.size());
  parallel_claims(n_items, [&](const auto& next) {
    std::vector<float> sbuf, qbuf, kbuf, abuf, tbuf;
    for (int64_t claim = next(); claim >= 0; claim = next()) {
      const auto [b, r0] = items[n_items - 1 - claim];
      const int64_t R = std::min(qsl[b + 1], r0 + kTileRows) - r0, M = R * group;
      const int64_t first = seq_lens[b] - (qsl[b + 1] - qsl[b]) + (r0 - qsl[b]);
      const int64_t S_min = first + 1, S_max = first + R;  // row i sees first + i + 1 keys
      // With a sliding window row i sees keys lo(i) .. first + i only; keys L_max .. S_min - 1 every row sees.
      auto lo = [&](int64_t i) { return window_first(first + i + 1, window); };
      const int64_t L_min = lo(0), L_max = lo(R - 1);
      const int64_t stride = (S_max + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
      const int64_t* table = block_tables + b * W;
      // Scores of query vector m = i * group + g of kv head kvh: row (kvh * M + m) of sc.
      float* sc = align64(sbuf, KVH * M * stride);
      float* qv = align64(qbuf, M * D);
      float* kT = align64(kbuf, D * kNR);
      float* acc = align64(abuf, KVH * M * D);
      float* tmp = align64(tbuf, kMR * kNR);
      std::fill(acc, acc + KVH * M * D, 0.f);
      for (int64_t kvh = 0; kvh < KVH; ++kvh) {
        for (int64_t i = 0; i < R; ++i) {
          const float* qr = q + (rw ? rw[r0 + i] : r0 + i) * qs + kvh * group * D;
          std::copy(qr, qr + group * D, qv + i * group * D);
        }
        float* skv = sc + kvh * M * stride;
        // Scores: kT = the next (up to) 16 keys transposed, [D][16]; every query vector times them. From the shared
        // transposition its chunks are the sequence's 16-key chunks (from the one holding L_min: a window's scores
        // before it are computed and never read); a key of the chunk past S_max gives a score column never copied.
        for (int64_t j0 = kall ? L_min / kNR * kNR : L_min; j0 < S_max; j0 += kNR) {
          const int64_t n = std::min(kNR, S_max - j0);
          const float* kTc = kT;
          if (kall) {
            kTc = kall + (coff[b] + kvh * nch[b] + j0 / kNR) * D * kNR;
          } else {
            transpose_keys(k_cache, table, BS, block_stride, row, kvh, D, j0, n, kT);
          }
          for (int64_t m0 = 0; m0 < M; m0 += kMR) {
            const int64_t Rm = std::min(kMR, M - m0);
            if (kall) {  // a 16-key chunk of the sequence: its 16 columns of the score rows (stride is 16 past j0)
              fixed::tile_rows<float, kNR, false>(Rm, qv + m0 * D, D, kTc, kNR, D, skv + m0 * stride + j0, stride,
                                                  scale);
              continue;
            }
            fixed::tile_rows<float, kNR, false>(Rm, qv + m0 * D, D, kTc, kNR, D, tmp, kNR);
            for (int64_t m = 0; m < Rm; ++m)
              for (int64_t t = 0; t < n; ++t) skv[(m0 + m) * stride + j0 + t] = tmp[m * kNR + t] * scale;
          }
        }
        for (int64_t m = 0; m < M; ++m) {
          const int64_t l = lo(m / group);
          softmax_inplace(skv + m * stride + l, first + m / group + 1 - l);
        }
        // Outputs, each one FMA chain over its row's keys in order: first each row's keys before L_max (a window's
        // rows whose first key is earlier than the last row's), one FMA step each; then keys [L_max, S_min) (seen by
        // every row) in tiles over each block's V rows, block by block; then each row's keys from S_min on.
        float* akv = acc + kvh * M * D;
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t j = lo(m / group); j < std::min(L_max, first + m / group + 1); ++j) {
            const S* vrow = v_cache + table[j / BS] * block_stride + (j % BS) * row + kvh * D;
            fixed::axpy_step(skv[m * stride + j], vrow, akv + m * D, D);
          }
        }
        for (int64_t j0 = L_max; j0 < S_min;) {
          const int64_t n = std::min(BS - j0 % BS, S_min - j0);
          const S* vblk = v_cache + table[j0 / BS] * block_stride + (j0 % BS) * row + kvh * D;
          if (j0 + n < S_min) {  // the next block's V rows of this kv head into L1 while this one's tiles run
            const int64_t j1 = j0 + n, n1 = std::min(BS, S_min - j1);
            const char* nb = reinterpret_cast<const char*>(v_cache + table[j1 / BS] * block_stride + kvh * D);
            for (int64_t t = 0; t < n1; ++t)
              for (int64_t o = 0; o < D * static_cast<int64_t>(sizeof(S)); o += 64)
                __builtin_prefetch(nb + t * row * static_cast<int64_t>(sizeof(S)) + o, 0, 3);
          }
          for (int64_t m0 = 0; m0 < M; m0 += kMR) {
            const int64_t Rm = std::min(kMR, M - m0);
            for (int64_t d0 = 0; d0 < D; d0 += kNR)
              fixed::tile_rows<S, 0, true>(Rm, skv + m0 * stride + j0, stride, vblk + d0, row, n, akv + m0 * D + d0, D);
          }
          j0 += n;
        }
        // Each row's keys past S_min (row i has i of them), one FMA step each, in key order.
        for (int64_t m = 0; m < M; ++m) {
          const int64_t ctx = first + m / group + 1;
          for (int64_t j = std::max(S_min, L_max); j < ctx; ++j) {
            const S* vrow = v_cache + table[j / BS] * block_stride + (j % BS) * row + kvh * D;
            fixed::axpy_step(skv[m * stride + j], vrow, akv + m * D, D);
          }
        }
        for (int64_t i = 0; i < R; ++i)
          std::copy(akv + i * group * D, akv + (i + 1) * group * D,
                    out + ((rw ? rw[r0 + i] : r0 + i) * H + kvh * group) * D);
      }
    }
  });
}

template <typename T>
void rows_kernel(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                 const int64_t* seq_lens, const int64_t* qsl, float* out, int64_t B, int64_t H, int64_t KVH,
                 int64_t D, int64_t BS, int64_t W, float scale, int64_t window) {
  const int64_t group = H / KVH, row = KVH * D, block_stride = BS * row;
  // Work items: (sequence, tile of up to kRowTile consecutive query rows).
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = qsl[b]; r < qsl[b + 1]; r += kRowTile) items.emplace_back(b, r);
  // Tiles to whichever thread is free, the last first (as rows_kernel_tiled).
  const int64_t n_items = static_cast<int64_t>(items.size());
  parallel_claims(n_items, [&](const auto& next) {
    std::vector<float> buf;
    for (int64_t claim = next(); claim >= 0; claim = next()) {
      const auto [b, r0] = items[n_items - 1 - claim];
      const int64_t r1 = std::min(qsl[b + 1], r0 + kRowTile), R = r1 - r0;
      const int64_t first = seq_lens[b] - (qsl[b + 1] - qsl[b]);  // context before this step's rows
      const int64_t S_max = first + (r1 - qsl[b]);                // the tile's last row sees this many
      const int64_t stride = (S_max + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
      buf.resize(R * H * stride + kAlignFloats);
      float* scores = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
      const int64_t* table = block_tables + b * W;
      auto ctx = [&](int64_t i) { return first + (r0 - qsl[b]) + i + 1; };  // keys row r0 + i sees: lo(i) .. ctx(i) - 1
      auto lo = [&](int64_t i) { return window_first(ctx(i), window); };
      const int64_t start = lo(0) / BS * BS;
      for (int64_t j0 = start; j0 < S_max; j0 += BS) {
        const T* base = k_cache + table[j0 / BS] * block_stride;
        const int64_t n = std::min(BS, S_max - j0);
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t i = 0; i < R; ++i) {
            if (j0 + t >= ctx(i) || j0 + t < lo(i)) continue;
            const float* qr = q + (r0 + i) * H * D;
            for (int64_t kvh = 0; kvh < KVH; ++kvh) {
              legacy::group_dots(qr + kvh * group * D, base + t * row + kvh * D, group, D, scale,
                                 scores + (i * H + kvh * group) * stride + j0 + t, stride);
            }
          }
        }
      }
      for (int64_t i = 0; i < R; ++i)
        for (int64_t h = 0; h < H; ++h) softmax_inplace(scores + (i * H + h) * stride + lo(i), ctx(i) - lo(i));
      float* o = out + r0 * H * D;
      std::fill(o, o + R * H * D, 0.f);
      for (int64_t j0 = start; j0 < S_max; j0 += BS) {
        const T* base = v_cache + table[j0 / BS] * block_stride;
        const int64_t n = std::min(BS, S_max - j0);
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t i = 0; i < R; ++i) {
            if (j0 + t >= ctx(i) || j0 + t < lo(i)) continue;
            for (int64_t h = 0; h < H; ++h) {
              const T* vrow = base + t * row + (h / group) * D;
              const float p = scores[(i * H + h) * stride + j0 + t];
              float* a = o + (i * H + h) * D;
#ifdef __AVX2__
              if (D % 8 == 0) {
                const __m256 pv = _mm256_set1_ps(p);
                for (int64_t d = 0; d < D; d += 8)
                  _mm256_storeu_ps(a + d, _mm256_fmadd_ps(pv, legacy::load8(vrow + d), _mm256_loadu_ps(a + d)));
                continue;
              }
#endif
              for (int64_t d = 0; d < D; ++d) a[d] = std::fma(p, legacy::to_f(vrow[d]), a[d]);
            }
          }
        }
      }
    }
  });
}

}  // namespace strict
}  // namespace pagedserve

namespace pagedserve {
namespace {

constexpr int64_t kMaxGroupChunk = 8;
constexpr int64_t kMaxHeadDim = 512;
#ifdef PAGEDSERVE_AVX512

// A cold pair's float32 passes (see RowStream): the next cache block's rows of this kv head (its D elements from
// base, n keys), into L1.
template <typename SC>
inline void prefetch_block(const SC* base, int64_t n, int64_t row, int64_t D) {
  for (int64_t t = 0; t < n; ++t) {
    const char* p = reinterpret_cast<const char*>(base + t * row);
    for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(SC)); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  }
}

// sc[g * S + j] = qf_g . k_j for the G heads of one chunk (q already scaled).
template <int G, typename SC>
void scores_pass(const float* qf, const SC* kc, const int64_t* table, int64_t S, int64_t BS, int64_t row,
                 int64_t D, float* sc, RowStream& ahead) {
  for (int64_t j0 = 0; j0 < S; j0 += BS) {
    const SC* base = kc + table[j0 / BS] * BS * row;
    const int64_t n = std::min(BS, S - j0);
    if (ahead.cold && j0 + BS < S)
      prefetch_block(kc + table[j0 / BS + 1] * BS * row, std::min(BS, S - j0 - BS), row, D);
    ahead.step(4);
    for (int64_t t = 0; t < n; ++t) {
      const SC* k = base + t * row;
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 kv = load16(k + d);
        for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + d), kv, acc[g]);
      }
      for (int g = 0; g < G; ++g) sc[g * S + j0 + t] = _mm512_reduce_add_ps(acc[g]);
    }
  }
}

// out_g[c : c + 16 * NV] = sum_j p_g[j] * v_j[c : c + 16 * NV], accumulated in registers.
template <int G, int NV, typename SC, typename SO>
void pv_chunk(const float* sc, const SC* vc, const int64_t* table, int64_t S, int64_t BS, int64_t row, int64_t D,
              int64_t c, SO* out, RowStream& ahead) {
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < NV; ++k) acc[g][k] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < S; j0 += BS) {
    const SC* base = vc + table[j0 / BS] * BS * row + c;
    const int64_t n = std::min(BS, S - j0);
    if (ahead.cold && j0 + BS < S)
      prefetch_block(vc + table[j0 / BS + 1] * BS * row + c, std::min(BS, S - j0 - BS), row, 16 * NV);
    for (int64_t t = 0; t < n; ++t) {
      ahead.step(1);
      __m512 v[NV];
      for (int k = 0; k < NV; ++k) v[k] = load16(base + t * row + 16 * k);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(sc[g * S + j0 + t]);
        for (int k = 0; k < NV; ++k) acc[g][k] = _mm512_fmadd_ps(p, v[k], acc[g][k]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < NV; ++k) store16(out + g * D + c + 16 * k, acc[g][k]);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDSERVE_DECODE_BF16 1
// Scores of G <= 4 bf16 query heads against a bf16 cache, 16 keys at a time: per key and head, ND = D / 32
// vdpbf16ps over the raw rows (16 lanes of partial sums, no widening), then one transpose-add tree turns the
// 16 keys' partial vectors into their 16 scores in key order (15 combine steps instead of 16 horizontal sums).
inline __m512 fold(__m512 a, __m512 b, __m512i lo, __m512i hi) {
  return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

// A cold pair's (see RowStream) bf16 scores pass at key j0, before its next n keys: the K and V rows of this kv head
// for keys j0 + kPrefetchKeys .. + n, and at the start (j0 = 0) the first kPrefetchKeys too: K into L1 for this pass,
// V into L2 for the P.V pass after.
constexpr int64_t kPrefetchKeys = 64;
inline void prefetch_ahead(const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t S, int64_t BS,
                           int64_t row, int64_t D, int64_t j0, int64_t n) {
  const int64_t pf0 = j0 == 0 ? 0 : j0 + kPrefetchKeys, pf1 = std::min(S, j0 + kPrefetchKeys + n);
  for (int64_t j = pf0; j < pf1; ++j) {
    const int64_t off = table[j / BS] * BS * row + (j % BS) * row;
    const char* pk = reinterpret_cast<const char*>(kc + off);
    const char* pv = reinterpret_cast<const char*>(vc + off);
    for (int64_t o = 0; o < D * 2; o += 64) {
      _mm_prefetch(pk + o, _MM_HINT_T0);
      _mm_prefetch(pv + o, _MM_HINT_T1);
    }
  }
}

template <int G, int ND>
void scores_pass_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t S,
                      int64_t BS, int64_t row, int64_t D, float scale, float* sc, RowStream& ahead) {
  const __m512i l1lo = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i l1hi = _mm512_add_epi32(l1lo, _mm512_set1_epi32(8));
  const __m512i l2lo = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i l2hi = _mm512_add_epi32(l2lo, _mm512_set1_epi32(4));
  const __m512i l3lo = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
  const __m512i l3hi = _mm512_add_epi32(l3lo, _mm512_set1_epi32(2));
  const __m512i l4lo = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i l4hi = _mm512_add_epi32(l4lo, _mm512_set1_epi32(1));
  __m512bh qv[G][ND];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < ND; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < S; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, S - j0);
    if (ahead.cold) prefetch_ahead(kc, vc, table, S, BS, row, D, j0, 16);
    ahead.step(4);
    __m512 d4[G][4];  // level-2 results: 4 keys each
    _Pragma("GCC unroll 4")
    for (int quad = 0; quad < 4; ++quad) {
      __m512 a[G][4];
      _Pragma("GCC unroll 4")
      for (int t = 0; t < 4; ++t) {
        const int64_t j = j0 + quad * 4 + t;
        if (quad * 4 + t < n) {
          const uint16_t* k = kc + table[j / BS] * BS * row + (j % BS) * row;
          __m512bh kv[ND];
          for (int c = 0; c < ND; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + 32 * c);
          for (int g = 0; g < G; ++g) {
            __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
            for (int c = 1; c < ND; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], kv[c]);
            a[g][t] = acc;
          }
        } else {
          for (int g = 0; g < G; ++g) a[g][t] = _mm512_setzero_ps();
        }
      }
      for (int g = 0; g < G; ++g)
        d4[g][quad] = fold(fold(a[g][0], a[g][1], l1lo, l1hi), fold(a[g][2], a[g][3], l1lo, l1hi), l2lo, l2hi);
    }
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    for (int g = 0; g < G; ++g) {
      const __m512 e0 = fold(d4[g][0], d4[g][1], l3lo, l3hi), e1 = fold(d4[g][2], d4[g][3], l3lo, l3hi);
      _mm512_mask_storeu_ps(sc + g * S + j0, live, _mm512_mul_ps(fold(e0, e1, l4lo, l4hi), sv));
    }
  }
}

// P.V of G <= 4 bf16 query heads against a bf16 cache, keys in pairs: the probabilities (normalized, float32 in sc,
// G rows of S) rounded to bf16 pairs (p_2t, p_2t+1) as the prefill row kernel rounds them, the V rows of keys 2t and
// 2t + 1 (one cache block: BS is even) interleaved into (v_2t[d], v_2t+1[d]) pairs of 16 d per register (vpermt2w),
// then one vdpbf16ps per 16 d adds both keys' products for a head (a key past S: p = 0 and v = 0). About a third of
// the instructions of pv_chunk's float32 path (which widens each V row and runs one FMA per key and 16 d).
// The G rows of probabilities (sc, G rows of S) rounded to bf16 pairs (p_2t, p_2t+1), row g at pairs + g * pstride
// (pstride: the (S + 1) / 2 pairs rounded up to 16, zero past S).
template <int G>
inline void round_pairs(const float* sc, int64_t S, int64_t pstride, uint32_t* pairs) {
  auto lanes = [](int64_t n) {  // the first n lanes (none for n <= 0, all 16 from n >= 16)
    return static_cast<__mmask16>(n <= 0 ? 0u : n >= 16 ? 0xFFFFu : (1u << n) - 1u);
  };
  for (int g = 0; g < G; ++g) {
    uint16_t* pg = reinterpret_cast<uint16_t*>(pairs + g * pstride);
    for (int64_t j = 0; j < 2 * pstride; j += 32) {
      const float* p = sc + g * S + j;
      const __m512 lo = _mm512_maskz_loadu_ps(lanes(S - j), p);
      const __m512 hi = _mm512_maskz_loadu_ps(lanes(S - j - 16), p + 16);
      _mm512_storeu_si512(pg + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// The V rows of keys j and j + 1 (j even: one cache block, BS being even) at d0 .. d0 + 63 as (v_j[d], v_j+1[d])
// pairs, 16 d per vector (vpermt2w); key j + 1 past S: v = 0 (its p is 0 too).
struct VPairs {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  inline void get(const uint16_t* vc, const int64_t* table, int64_t j, int64_t S, int64_t BS, int64_t row, int64_t d0,
                  __m512i w[4]) const {
    const uint16_t* v0 = vc + table[j / BS] * BS * row + (j % BS) * row + d0;
    const __m512i a0 = _mm512_loadu_si512(v0), a1 = _mm512_loadu_si512(v0 + 32);
    __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
    if (j + 1 < S) {
      b0 = _mm512_loadu_si512(v0 + row);
      b1 = _mm512_loadu_si512(v0 + row + 32);
    }
    w[0] = _mm512_permutex2var_epi16(a0, lo, b0);
    w[1] = _mm512_permutex2var_epi16(a0, hi, b0);
    w[2] = _mm512_permutex2var_epi16(a1, lo, b1);
    w[3] = _mm512_permutex2var_epi16(a1, hi, b1);
  }
};

template <int G, typename SO>
void pv_pairs_bf16(const float* sc, const uint16_t* vc, const int64_t* table, int64_t S, int64_t BS, int64_t row,
                   int64_t D, SO* out, std::vector<uint32_t>& pairs, RowStream& ahead) {
  const int64_t np = (S + 1) / 2, pstride = (np + 15) / 16 * 16;
  pairs.resize(G * pstride + 16);
  round_pairs<G>(sc, S, pstride, pairs.data());
  const VPairs vp;
  for (int64_t c = 0; c < D; c += 64) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < 4; ++k) acc[g][k] = _mm512_setzero_ps();
    for (int64_t t = 0; t < np; ++t) {
      ahead.step(2);
      __m512i w[4];
      vp.get(vc, table, 2 * t, S, BS, row, c, w);
      for (int g = 0; g < G; ++g)
        for (int k = 0; k < 4; ++k)
          acc[g][k] = dpbf16_bcast(acc[g][k], pairs.data() + g * pstride + t, (__m512bh)w[k]);
    }
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < 4; ++k) store16(out + g * D + c + 16 * k, acc[g][k]);
  }
}

#ifdef PAGEDSERVE_AMX
// The same scores on AMX tiles (amx_active; D % 64 == 0; the calling task has the tiles configured to 16 rows):
// S^T = K Q^T per 16 keys. A cache block's 16 K rows of this kv head are D / 32 A tiles as they lie (row stride
// `row`), the G query heads' q as many B tiles ((d, d + 1) pairs, [d / 2][16 columns], columns past G zero; for
// D = 64 the two loaded once per call), so each score is one chain of D / 32 TDPBF16PS over the d chunks in order;
// column g of a C tile (16 keys) is head g's scores. Two 16-key runs at a time on their own A and C tiles (AMX does
// not rename tiles: one C tile's chain, store and read-back serialize). Needs the cache block size to be a multiple
// of 16 (16 keys never straddle two blocks).
template <int G>
void scores_pass_amx(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t S,
                     int64_t BS, int64_t row, int64_t D, float scale, float* sc, RowStream& ahead) {
  static_assert(G <= 16);
  const int64_t nd = D / 32;  // D % 64 == 0: the d chunks go in pairs
  alignas(64) uint16_t qb[kMaxHeadDim / 32][16 * 32];
  std::memset(qb, 0, sizeof(uint16_t) * 16 * 32 * nd);
  for (int64_t c = 0; c < nd; ++c)
    for (int kk = 0; kk < 16; ++kk)
      for (int g = 0; g < G; ++g) {
        qb[c][kk * 32 + 2 * g] = q[g * D + 32 * c + 2 * kk];
        qb[c][kk * 32 + 2 * g + 1] = q[g * D + 32 * c + 2 * kk + 1];
      }
  const bool hoist = nd == 2;  // D = 64: the two B tiles once per call
  if (hoist) {
    _tile_loadd(6, qb[0], 64);
    _tile_loadd(7, qb[1], 64);
  }
  alignas(64) float ct[2][16 * 16];
  const __m512i col = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
  const __m512 sv = _mm512_set1_ps(scale);
  // The last run of keys, where fewer than 16 (S % 16 of them): their rows copied into `tail`, zero past them, and
  // the tiles loaded from there. Loaded in place, the A tiles read 16 rows of the block, those past S never asked
  // for ahead (RowStream) and cold: at W1's 129 keys that took the decode attention 0.73 -> 0.83 ms per layer.
  alignas(64) uint16_t tail[16 * kMaxHeadDim];
  auto rows_of = [&](int64_t j, int64_t& stride) -> const uint16_t* {
    const uint16_t* k = kc + table[j / BS] * BS * row + (j % BS) * row;
    stride = row * 2;
    const int64_t n = S - j;
    if (n >= 16) return k;
    for (int64_t r = 0; r < n; ++r) std::memcpy(tail + r * D, k + r * row, D * 2);
    std::memset(tail + n * D, 0, (16 - n) * D * 2);
    stride = D * 2;
    return tail;
  };
  for (int64_t j0 = 0; j0 < S; j0 += 32) {
    if (ahead.cold) prefetch_ahead(kc, vc, table, S, BS, row, D, j0, 32);
    ahead.step(8);
    int64_t rb0 = 0, rb1 = 0;
    const uint16_t* k0 = rows_of(j0, rb0);
    const bool two = j0 + 16 < S;
    const uint16_t* k1 = two ? rows_of(j0 + 16, rb1) : k0;
    _tile_zero(0);
    if (two) _tile_zero(1);
    for (int64_t c = 0; c < nd; c += 2) {  // each score: one chain over the d chunks in order
      if (!hoist) {
        _tile_loadd(6, qb[c], 64);
        _tile_loadd(7, qb[c + 1], 64);
      }
      _tile_loadd(2, k0 + 32 * c, rb0);
      _tile_loadd(3, k0 + 32 * (c + 1), rb0);
      if (two) {
        _tile_loadd(4, k1 + 32 * c, rb1);
        _tile_loadd(5, k1 + 32 * (c + 1), rb1);
        _tile_dpbf16ps(0, 2, 6);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(0, 3, 7);
        _tile_dpbf16ps(1, 5, 7);
      } else {
        _tile_dpbf16ps(0, 2, 6);
        _tile_dpbf16ps(0, 3, 7);
      }
    }
    _tile_stored(0, ct[0], 64);
    if (two) _tile_stored(1, ct[1], 64);
    for (int h = 0; h < (two ? 2 : 1); ++h) {
      const int64_t js = j0 + 16 * h, n = std::min<int64_t>(16, S - js);
      const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
      for (int g = 0; g < G; ++g) {
        const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32(g)), ct[h], 4);
        _mm512_mask_storeu_ps(sc + g * S + js, live, _mm512_mul_ps(v, sv));
      }
    }
  }
}

// P.V on AMX tiles (with scores_pass_amx: D % 64 == 0, the tiles configured to 16 rows), 64 d at a time (a pass over
// the keys each). Per 32 keys, C tile c (the G heads' outputs at d = d0 + 16 c ..) += P . V_c: the A tile is the G
// rows of 16 probability pairs as round_pairs lays them out (rows past G are read and their outputs ignored), B tile
// V_c the 16 key pairs' VPairs of those 16 d, stored into a buffer (two, alternating). The same probabilities as
// pv_pairs_bf16, summed by TDPBF16PS; on a Sapphire Rapids a VDPBF16PS takes 2 cycles, so that route's 12 per key pair
// (3 heads) were most of a W1 task's time.
template <int G, typename SO>
void pv_pairs_amx(const float* sc, const uint16_t* vc, const int64_t* table, int64_t S, int64_t BS, int64_t row,
                  int64_t D, SO* out, std::vector<uint32_t>& pairs, RowStream& ahead) {
  static_assert(G <= 16);
  const int64_t np = (S + 1) / 2, pstride = (np + 15) / 16 * 16;
  pairs.resize(16 * pstride + 16);
  round_pairs<G>(sc, S, pstride, pairs.data());
  const VPairs vp;
  alignas(64) uint16_t vb[2][4][16 * 32];
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // 64 d at a time (4 C tiles), each a pass over the keys
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t0 = 0, i = 0; t0 < np; t0 += 16, ++i) {
      uint16_t(*b)[16 * 32] = vb[i & 1];
      const int64_t nt = std::min<int64_t>(16, np - t0);
      for (int64_t u = 0; u < nt; ++u) {
        ahead.step(2);
        __m512i w[4];
        vp.get(vc, table, 2 * (t0 + u), S, BS, row, d0, w);
        for (int c = 0; c < 4; ++c) _mm512_store_si512(b[c] + u * 32, w[c]);
      }
      for (int64_t u = nt; u < 16; ++u)  // past the last pair: zeros (stale bits could be a NaN; 0 * NaN is NaN)
        for (int c = 0; c < 4; ++c) _mm512_store_si512(b[c] + u * 32, _mm512_setzero_si512());
      _tile_loadd(5, pairs.data() + t0, pstride * 4);
      _tile_loadd(6, b[0], 64);
      _tile_dpbf16ps(0, 5, 6);
      _tile_loadd(7, b[1], 64);
      _tile_dpbf16ps(1, 5, 7);
      _tile_loadd(6, b[2], 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, b[3], 64);
      _tile_dpbf16ps(3, 5, 7);
    }
    alignas(64) float ct[4][16 * 16];
    _tile_stored(0, ct[0], 64);
    _tile_stored(1, ct[1], 64);
    _tile_stored(2, ct[2], 64);
    _tile_stored(3, ct[3], 64);
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) store16(out + g * D + d0 + 16 * c, _mm512_load_ps(ct[c] + g * 16));
  }
}
#endif

#endif

// One task's attention: G query heads of one kv head over S keys from `table` (the first `skip` masked). out: G
// rows of D (SO: the query's dtype, or float32 for a partition of a split sequence, whose softmax's max and sum
// per head go to stats[2 g], stats[2 g + 1]).
template <int G, typename SC, typename SQ, typename SO>
void attend_chunk(const float* qf, const SQ* qraw, float scale, const SC* kc, const SC* vc, const int64_t* table,
                  int64_t S, int64_t BS, int64_t row, int64_t D, std::vector<float>& sc, SO* out,
                  [[maybe_unused]] bool tiles, int64_t skip, float* stats, RowStream& ahead) {
  sc.resize(G * S + 16);
  bool done = false;
#if defined(PAGEDSERVE_DECODE_BF16) && defined(PAGEDSERVE_AMX)
  if constexpr (std::is_same_v<SC, uint16_t> && std::is_same_v<SQ, uint16_t>) {
    if (tiles) {  // decode_avx512 checked D and the block size
      scores_pass_amx<G>(qraw, kc, vc, table, S, BS, row, D, scale, sc.data(), ahead);
      done = true;
    }
  }
#endif
#ifdef PAGEDSERVE_DECODE_BF16
  if constexpr (std::is_same_v<SC, uint16_t> && std::is_same_v<SQ, uint16_t> && G <= 4) {
    if (!done && D == 64) {
      scores_pass_bf16<G, 2>(qraw, kc, vc, table, S, BS, row, D, scale, sc.data(), ahead);
      done = true;
    } else if (!done && D == 128) {
      scores_pass_bf16<G, 4>(qraw, kc, vc, table, S, BS, row, D, scale, sc.data(), ahead);
      done = true;
    }
  }
#endif
  if (!done) scores_pass<G>(qf, kc, table, S, BS, row, D, sc.data(), ahead);
  mask_skipped(sc.data(), G, S, skip);
  for (int g = 0; g < G; ++g) softmax_inplace(sc.data() + g * S, S, stats ? stats + 2 * g : nullptr);
#ifdef PAGEDSERVE_DECODE_BF16
  if constexpr (std::is_same_v<SC, uint16_t> && std::is_same_v<SQ, uint16_t>) {
    thread_local std::vector<uint32_t> pairs;
#ifdef PAGEDSERVE_AMX
    if (tiles) {  // D % 64 == 0, BS % 16 == 0
      pv_pairs_amx<G>(sc.data(), vc, table, S, BS, row, D, out, pairs, ahead);
      return;
    }
#endif
    if constexpr (G <= 4) {
      if (D % 64 == 0 && BS % 2 == 0) {
        pv_pairs_bf16<G>(sc.data(), vc, table, S, BS, row, D, out, pairs, ahead);
        return;
      }
    }
  }
#endif

  int64_t c = 0;
  for (; c + 64 <= D; c += 64) pv_chunk<G, 4>(sc.data(), vc, table, S, BS, row, D, c, out, ahead);
  switch ((D - c) / 16) {
    case 3: pv_chunk<G, 3>(sc.data(), vc, table, S, BS, row, D, c, out, ahead); break;
    case 2: pv_chunk<G, 2>(sc.data(), vc, table, S, BS, row, D, c, out, ahead); break;
    case 1: pv_chunk<G, 1>(sc.data(), vc, table, S, BS, row, D, c, out, ahead); break;
    default: break;
  }
}

// G (1 .. kMaxGroupChunk) as a template argument.
template <typename SC, typename SQ, typename SO>
void attend_group(int64_t G, const float* qf, const SQ* qs, float scale, const SC* k, const SC* v,
                  const int64_t* table, int64_t S, int64_t BS, int64_t row, int64_t D, std::vector<float>& sc, SO* o,
                  bool tiles, int64_t skip, float* stats, RowStream& ahead) {
  switch (G) {
    case 1: attend_chunk<1>(qf, qs, scale, k, v, table, S, BS, row, D, sc, o, tiles, skip, stats, ahead); break;
    case 2: attend_chunk<2>(qf, qs, scale, k, v, table, S, BS, row, D, sc, o, tiles, skip, stats, ahead); break;
    case 3: attend_chunk<3>(qf, qs, scale, k, v, table, S, BS, row, D, sc, o, tiles, skip, stats, ahead); break;
    case 4: attend_chunk<4>(qf, qs, scale, k, v, table, S, BS, row, D, sc, o, tiles, skip, stats, ahead); break;
    case 5: attend_chunk<5>(qf, qs, scale, k, v, table, S, BS, row, D, sc, o, tiles, skip, stats, ahead); break;
    case 6: attend_chunk<6>(qf, qs, scale, k, v, table, S, BS, row, D, sc, o, tiles, skip, stats, ahead); break;
    case 7: attend_chunk<7>(qf, qs, scale, k, v, table, S, BS, row, D, sc, o, tiles, skip, stats, ahead); break;
    default: attend_chunk<8>(qf, qs, scale, k, v, table, S, BS, row, D, sc, o, tiles, skip, stats, ahead); break;
  }
}

// A batch of fewer tasks than two per thread (one sequence: KVH * chunks tasks, 3 for SmolLM2, 1 for Gemma 3) cannot
// keep the threads busy over a long context; there each sequence of 1,024 keys or more is split into partitions of
// whole cache blocks, ~kPartKeys keys each (flash-decoding's split-K): a task is then one (sequence, partition, kv
// head, group chunk), its softmax and P.V over the partition alone (float32 out, with the partition's max and sum
// per head), and a head's partitions are combined at the end, each weighted by its sum times e^(its max - the
// overall max). Where the batch has tasks enough nothing is split: every partition's first keys arrive cold (random
// blocks), which cost more than the balance gains there, as do partitions of fewer keys. So a split sequence's bits
// depend on the batch and the thread count (as the matmuls' routes do); the strict mode (batch_invariant) runs its
// own row kernel. Where a thread would have no task at all (Gemma 3's one kv head), partitions of kMinPartKeys keys
// are taken as well (its sliding layers' 512-key windows).
// Head sizes decode_avx512 takes (paged_decode_attention's route; the team's check, decode_attention_in_team).
inline bool decode_avx512_takes(int64_t D) { return D % 16 == 0 && D <= kMaxHeadDim; }

constexpr int64_t kSplitTasksPerThread = 2;
constexpr int64_t kPartKeys = 512, kMinPartKeys = 256;

// Partitions for S keys when the batch has `tasks` tasks on `threads` threads; keys per partition in *keys.
inline int64_t decode_parts(int64_t S, int64_t BS, int64_t tasks, int64_t threads, int64_t* keys) {
  if (tasks >= kSplitTasksPerThread * threads) return 1;
  int64_t want = S / kPartKeys;
  if (tasks < threads) want = std::max(want, std::min((kSplitTasksPerThread * threads + tasks - 1) / tasks,
                                                      S / kMinPartKeys));
  const int64_t nb = (S + BS - 1) / BS;
  if (want < 2 || nb < 2) return 1;
  const int64_t per = (nb + want - 1) / want;  // blocks per partition
  *keys = per * BS;
  return (nb + per - 1) / per;
}

template <typename SC, typename SQ>
void decode_avx512(const SQ* q, int64_t q_stride, const int64_t* rows, const SC* kc, const SC* vc,
                   const int64_t* block_tables, int64_t bt_stride, const int64_t* seq_lens, SQ* out,
                   int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale, int64_t window) {
  const int64_t group = H / KVH;
  const int64_t chunks = (group + kMaxGroupChunk - 1) / kMaxGroupChunk;
  const int64_t row = KVH * D;
  // Scores and P.V on AMX tiles where they run (bf16 query and cache, D % 64 == 0, 16-key runs inside cache blocks).
  bool use_tiles = false;
#if defined(PAGEDSERVE_DECODE_BF16) && defined(PAGEDSERVE_AMX)
  use_tiles = std::is_same_v<SC, uint16_t> && std::is_same_v<SQ, uint16_t> && D % 64 == 0 && D <= kMaxHeadDim &&
              BS % 16 == 0 && amx_active();
#endif
  // The (sequence, partition) pairs in order; a sequence split into P > 1 partitions owns the partial results
  // first_part[b] .. + P - 1 (-1: not split, written straight into out).
  std::vector<WindowSpan> spans(B);
  std::vector<int64_t> first_part(B, -1), parts(B, 1), per_part(B, 0), pair_b, pair_p;
  pair_b.reserve(B);
  pair_p.reserve(B);
  int64_t nsplit = 0;
  const int64_t tasks = B * KVH * chunks, threads = g_team.t >= 0 ? g_team.n : at::get_num_threads();
  for (int64_t b = 0; b < B; ++b) {
    spans[b] = window_span(block_tables + b * bt_stride, seq_lens[b], BS, window);
    const int64_t P = parts[b] = decode_parts(spans[b].S, BS, tasks, threads, &per_part[b]);
    if (P > 1) {  // per_part[b] keys per partition (the last may have fewer)
      first_part[b] = nsplit;
      nsplit += P;
    }
    for (int64_t p = 0; p < P; ++p) {
      pair_b.push_back(b);
      pair_p.push_back(p);
    }
  }
  const int64_t npairs = static_cast<int64_t>(pair_b.size());
  // The partitions' results [nsplit, H, D] and their (max, sum) [nsplit, H, 2]; in a decode team the members' shared
  // scratch (every member reaches the same split), sized by thread 0 before the first pass.
  std::vector<float> own;
  TORCH_CHECK(g_team.t < 0 || nsplit == 0 || (g_team.scratch && g_team.barrier),
              "paged_decode_attention: a split batch in a team without its scratch");
  std::vector<float>& parts_buf = g_team.t >= 0 && nsplit > 0 ? *g_team.scratch : own;
  if (g_team.t <= 0) parts_buf.resize(nsplit * H * (D + 2));
  if (g_team.t >= 0 && nsplit > 0) team_sync();
  float* const part_out = parts_buf.data();
  float* const part_stats = part_out + nsplit * H * D;
  const int64_t per_pair = KVH * chunks;
  // The keys pair pr attends: its sequence's span, or its partition of it.
  auto pair_span = [&](int64_t pr) -> WindowSpan {
    const int64_t bb = pair_b[pr], pp = pair_p[pr];
    const WindowSpan& sp = spans[bb];
    if (first_part[bb] < 0) return sp;
    const int64_t k0 = pp * per_part[bb];
    return {sp.table + k0 / BS, std::min(per_part[bb], sp.S - k0), pp == 0 ? sp.skip : 0};
  };
  team_for(npairs * per_pair, 1, [&](int64_t begin, int64_t end) {  // a team: this thread's share
    thread_local std::vector<float> sc;
#if defined(PAGEDSERVE_DECODE_BF16) && defined(PAGEDSERVE_AMX)
    amx::Tiles tiles;
    if (use_tiles) tiles.use(16);
#endif
    alignas(64) float qf[kMaxGroupChunk * kMaxHeadDim];
    // RowStream over the rows of pair pr that this thread reads (its kv heads there, of items begin .. end - 1).
    RowStream rows_ahead;
    auto stream_pair = [&](int64_t pr) {
      const int64_t i0 = std::max(begin, pr * per_pair), i1 = std::min(end, (pr + 1) * per_pair) - 1;
      const WindowSpan ps = pair_span(pr);
      const int64_t eb = static_cast<int64_t>(sizeof(SC)) * D;
      rows_ahead.start(kc, vc, ps.table, ps.S, BS, row * static_cast<int64_t>(sizeof(SC)), (i0 / chunks) % KVH * eb,
                       ((i1 / chunks) % KVH + 1) * eb);
    };
    // The work of this thread's items of pair pr, items times keys: a pair's units of work are foreseen as the last
    // pair's, scaled by the two works.
    auto pair_work = [&](int64_t pr) {
      const int64_t i0 = std::max(begin, pr * per_pair), i1 = std::min(end, (pr + 1) * per_pair);
      return std::max<int64_t>(1, (i1 - i0) * pair_span(pr).S);
    };
    int64_t last_work = 0;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / per_pair, kvh = (item / chunks) % KVH, ch = item % chunks;
      const int64_t b = pair_b[pair], p = pair_p[pair];
      if (item == begin || item % per_pair == 0) {  // a new pair: the rest of its rows now, the next pair's during it
        const int64_t last_units = rows_ahead.used, work = pair_work(pair);
        rows_ahead.finish();
        rows_ahead.cold = item == begin;
        if ((pair + 1) * per_pair < end) stream_pair(pair + 1);
        else rows_ahead.stop();
        rows_ahead.pace(last_work > 0 ? last_units * work / last_work : 0);
        last_work = work;
      }
      const int64_t h0 = kvh * group + ch * kMaxGroupChunk;
      const int64_t G = std::min(kMaxGroupChunk, group - ch * kMaxGroupChunk);
      const int64_t r = rows ? rows[b] : b;
      const SQ* qs = q + r * q_stride + h0 * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = Elem<SQ>::load(qs[i]) * scale;
      const WindowSpan span = pair_span(pair);
      const SC* k = kc + kvh * D;
      const SC* v = vc + kvh * D;
      if (first_part[b] < 0) {
        attend_group(G, qf, qs, scale, k, v, span.table, span.S, BS, row, D, sc, out + (r * H + h0) * D, use_tiles,
                     span.skip, static_cast<float*>(nullptr), rows_ahead);
      } else {
        const int64_t part = first_part[b] + p;
        attend_group(G, qf, qs, scale, k, v, span.table, span.S, BS, row, D, sc, part_out + (part * H + h0) * D,
                     use_tiles, span.skip, part_stats + (part * H + h0) * 2, rows_ahead);
      }
    }
  });
  if (nsplit == 0) return;
  // Each split sequence's heads: out = sum_p w_p o_p / sum_p w_p, w_p = sum_p e^(max_p - max). In a team, once every
  // member's partitions are done.
  if (g_team.t >= 0) team_sync();
  std::vector<int64_t> split;
  for (int64_t b = 0; b < B; ++b)
    if (first_part[b] >= 0) split.push_back(b);
  team_for(static_cast<int64_t>(split.size()) * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w, acc(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = split[item / H], h = item % H;
      const int64_t P = parts[b], p0 = first_part[b];
      float m = part_stats[(p0 * H + h) * 2];
      for (int64_t p = 1; p < P; ++p) m = std::max(m, part_stats[((p0 + p) * H + h) * 2]);
      w.resize(P);
      float total = 0.f;
      for (int64_t p = 0; p < P; ++p) {
        const float* st = part_stats + ((p0 + p) * H + h) * 2;
        w[p] = st[1] * expf(st[0] - m);
        total += w[p];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < P; ++p) {
        const float wp = w[p] / total;
        const float* o = part_out + ((p0 + p) * H + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += wp * o[d];
      }
      SQ* dst = out + ((rows ? rows[b] : b) * H + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = Elem<SQ>::store(acc[d]);
    }
  });
}
#endif

}  // namespace

// Whether DecodeStack's team may run paged_decode_attention for this batch (every sequence's context below
// block_tables' reach, checked by the caller's kernels): where its tasks split through team_for — decode_avx512 (a
// split sequence's partitions are combined after a team_sync), or, in an AVX2 build, decode_kernel's register passes
// over float32 queries (read and written in place).
bool decode_attention_in_team(c10::ScalarType q_dtype, int64_t H, const torch::Tensor& k_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens) {
#if defined(PAGEDSERVE_AVX512) || defined(__AVX2__)
  const int64_t B = block_tables.size(0), W = block_tables.size(1), D = k_cache.size(3);
  const int64_t KVH = k_cache.size(2), BS = k_cache.size(1);
  const bool caches = k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16;
#ifdef PAGEDSERVE_AVX512
  const bool route = (q_dtype == torch::kFloat32 || q_dtype == torch::kBFloat16) && decode_avx512_takes(D);
#else
  const bool route = q_dtype == torch::kFloat32 && legacy::decode_heads_take(D);
#endif
  if (!caches || !route || KVH < 1 || H % KVH != 0 || seq_lens.numel() != B) return false;
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    if (sl[b] < 1 || sl[b] > W * BS) return false;  // the kernel's own checks raise on it: outside the team
  return true;
#else
  (void)q_dtype, (void)H, (void)k_cache, (void)block_tables, (void)seq_lens;
  return false;
#endif
}

// q: [T, H, D] (float32 or bf16; rows may be strided, heads contiguous), caches: [num_blocks, block_size,
// KVH, D] float32 or bfloat16, block_tables: [B, max_blocks] int64, seq_lens: [B] int64 (context length
// including the new token), rows: [B] int64 token index of each sequence's query in q (empty: row b),
// out: [T, H, D] contiguous, q's dtype; rows of out not named by `rows` are left untouched.
void paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor rows,
                            torch::Tensor out, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_decode_attention: q must be [T, H, D] with contiguous heads");
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: caches must be contiguous [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "paged_decode_attention: out must be contiguous, shaped and typed like q");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous() &&
                  rows.scalar_type() == torch::kInt64 && rows.is_contiguous(),
              "paged_decode_attention: block_tables, seq_lens and rows must be contiguous int64");
  const int64_t B = block_tables.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2), BS = k_cache.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D, "paged_decode_attention: head shapes do not match");
  TORCH_CHECK(seq_lens.numel() == B && (rows.numel() == B || (rows.numel() == 0 && q.size(0) == B)),
              "paged_decode_attention: seq_lens/rows must have one entry per sequence");
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* rw = rows.numel() ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {  // a bad table must raise, never read outside the cache
    TORCH_CHECK(sl[b] >= 1 && sl[b] <= block_tables.size(1) * BS, "paged_decode_attention: bad seq_len ", sl[b]);
    TORCH_CHECK(!rw || (rw[b] >= 0 && rw[b] < q.size(0)), "paged_decode_attention: bad row ", rw ? rw[b] : 0);
    for (int64_t j = 0; j < (sl[b] + BS - 1) / BS; ++j) {
      const int64_t id = bt[b * block_tables.size(1) + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode_attention: block id ", id, " is outside the cache");
    }
  }
#ifdef PAGEDSERVE_AVX512
  if (decode_avx512_takes(D)) {
    const float sc = static_cast<float>(scale);
    dispatch_float_bf16(q, "paged_decode_attention", [&]<typename SQ>() {
      dispatch_float_bf16(k_cache, "paged_decode_attention", [&]<typename SC>() {
        decode_avx512<SC, SQ>(ptr<SQ>(q), q.stride(0), rw, ptr<SC>(k_cache), ptr<SC>(v_cache), bt,
                              block_tables.size(1), sl, ptr<SQ>(out), B, H, KVH, D, BS, sc, window);
      });
    });
    return;
  }
#endif
  // Float32 queries read in place and results written there; other queries converted (gathered contiguously, the
  // results scattered back).
  const bool in_place = q.scalar_type() == torch::kFloat32;
  const torch::Tensor qf = in_place ? q : (rw ? q.index_select(0, rows) : q).to(torch::kFloat32).contiguous();
  const torch::Tensor res = in_place ? out : torch::empty({B, H, D}, qf.options());
  dispatch_float_bf16(k_cache, "paged_decode_attention", [&]<typename SC>() {
    using T = std::conditional_t<std::is_same_v<SC, float>, float, c10::BFloat16>;
    legacy::decode_kernel<T>(qf.data_ptr<float>(), qf.stride(0), in_place ? rw : nullptr,
                             reinterpret_cast<const T*>(ptr<SC>(k_cache)), reinterpret_cast<const T*>(ptr<SC>(v_cache)),
                             bt, sl, res.data_ptr<float>(), B, H, KVH, D, BS, block_tables.size(1),
                             static_cast<float>(scale), window);
  });
  if (in_place) return;
  if (rw) {
    out.index_copy_(0, rows, res.to(out.scalar_type()));
  } else {
    out.copy_(res);
  }
}

}  // namespace pagedserve

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(PAGEDSERVE_AVX512)
#define PAGEDSERVE_ROWS_BF16 1
namespace pagedserve {
namespace rows_bf16 {

// The row kernels for bf16 queries and a bf16 cache (AVX512-BF16 CPUs; AMX tiles where amx_active()): flash-style,
// transposed so that a vector register holds 16 query vectors (one lane each) and the online softmax needs no
// horizontal reductions:
//   * per (sequence, kv head), K is laid out in rows [32-key block][32 keys][D] and V transposed [block][D][32 keys]
//     (zeros past the sequence's last key), shared by all the sequence's query tiles;
//   * 16 query vectors at a time (their q as (d, d + 1) pairs, qT [d / 2][16 vectors]): the scores of a block are
//     S^T [32 keys][16 vectors], each one chain over the d pairs in order;
//   * online softmax over absolute 32-key blocks, lane-wise (max over the block's keys, exp2_16 of the scores in
//     log2 units, masked past each vector's context), probabilities rounded to bf16 as (key 2 t, 2 t + 1) pairs: P^T;
//   * O^T [D][16 vectors] += V^T P^T, each output lane one chain over the block's key pairs, scaled by the vector's
//     e^(m_old - m_new) (1.0 exactly where its max did not grow) when some vector's max grew.
// Still row kernels: a lane's sums depend only on that vector's operands, and every step above is per vector in an
// order fixed by its own context (blocks are absolute, keys 32 j .. 32 j + 31 of the sequence, visited in order from
// block 0; a block a vector does not see leaves it unchanged: p = 0, alpha = 1), so a prompt's rows are the same bits
// however it is chunked or batched (as strict::rows_kernel's are; the tests check it).
//
// Two routes run this scheme: vdpbf16ps (run_avx512: scores as 16 register chains of one key each with K pairs
// broadcast from memory, P.V as 16 d of O^T in registers at a time) and AMX tiles (rows_amx::run). Their bits
// differ (TDPBF16PS sums a step's pairs its own way); a process runs one of them (amx_active, switched by set_amx).
constexpr int64_t kTile = 16;   // query rows per work item
constexpr int64_t kBlock = 32;  // keys per softmax block

// Work items: (sequence, tile of kTile query rows, kv head), the ones with the longest context (the most key blocks)
// first; the threads take them in that order from a shared counter, so that a thread slowed down (or a prompt's
// late rows, which cost more than its early ones) does not leave the other waiting at the end. An item's result does
// not depend on which thread runs it.
inline std::vector<std::tuple<int64_t, int64_t, int64_t>> work_items(const int64_t* qsl, const int64_t* seq_lens,
                                                                     int64_t B, int64_t KVH) {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = qsl[b]; r < qsl[b + 1]; r += kTile)
      for (int64_t kvh = 0; kvh < KVH; ++kvh) items.emplace_back(b, r, kvh);
  auto end = [&](const std::tuple<int64_t, int64_t, int64_t>& item) {  // context of the tile's last row
    const int64_t b = std::get<0>(item), left = qsl[b + 1] - std::get<1>(item);  // rows from r0 to the end
    return seq_lens[b] - left + std::min(kTile, left);
  };
  std::stable_sort(items.begin(), items.end(), [&](const auto& x, const auto& y) { return end(x) > end(y); });
  return items;
}

// One work item: sequence b's query rows r0 .. r0 + R - 1 for kv head kvh, M = R * group query vectors; row i of
// the tile sees keys 0 .. first + i, or with a sliding window (window > 0) its last `window` of them only.
// rows (null: the identity) maps the call's row i to its row of q and out.
struct RowTile {
  int64_t b, r0, kvh, R, first, M, window;
  const int64_t* rows;
  RowTile(const std::tuple<int64_t, int64_t, int64_t>& item, const int64_t* qsl, const int64_t* seq_lens, int64_t group,
          const int64_t* rows, int64_t window)
      : b(std::get<0>(item)), r0(std::get<1>(item)), kvh(std::get<2>(item)),
        R(std::min(qsl[b + 1], r0 + kTile) - r0), first(seq_lens[b] - (qsl[b + 1] - qsl[b]) + (r0 - qsl[b])),
        M(R * group), window(window), rows(rows) {}
  int64_t row(int64_t i) const { return rows ? rows[r0 + i] : r0 + i; }  // q / out row of the tile's row i
  // The first key row i sees (its context is first + i + 1 keys).
  int64_t lo(int64_t i) const { return window_first(first + i + 1, window); }
};

// A 16 x 16 matrix of 32-bit elements, one row per register, transposed in place (r[i] lane j <-> r[j] lane i):
// four butterfly stages (h = 8, 4, 2, 1), each exchanging the off-diagonal h x h sub-blocks of every 2h x 2h block:
// rows i and i + h (i & h clear) become new_a[j] = (j & h) ? b[j - h] : a[j], new_b[j] = (j & h) ? b[j] : a[j + h].
struct TransposeIdx {
  alignas(64) int32_t a[4][16], b[4][16];
  constexpr TransposeIdx() : a{}, b{} {
    for (int s = 0; s < 4; ++s) {
      const int h = 8 >> s;
      for (int j = 0; j < 16; ++j) {
        a[s][j] = (j & h) ? 16 + j - h : j;  // lanes 16.. of permutex2var are b's
        b[s][j] = (j & h) ? 16 + j : j + h;
      }
    }
  }
};
inline constexpr TransposeIdx kTransposeIdx{};

inline void transpose16(__m512i r[16]) {
  _Pragma("GCC unroll 16")
  for (int s = 0; s < 4; ++s) {
    const int h = 8 >> s;
    const __m512i ia = _mm512_load_si512(kTransposeIdx.a[s]), ib = _mm512_load_si512(kTransposeIdx.b[s]);
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      const __m512i x = r[i], y = r[i + h];
      r[i] = _mm512_permutex2var_epi32(x, ia, y);
      r[i + h] = _mm512_permutex2var_epi32(x, ib, y);
    }
  }
}

// Every (sequence, kv head)'s K as rows [block][32 keys][D] and V^T [block][D][32 keys] (see above), from the
// sequence's block b0 on (0; with a sliding window, the block of the first key any of its rows sees).
struct Layout {
  std::vector<int64_t> nb, base, b0;
  uint16_t *K0, *V0;  // in the calling thread's buffers (below), valid until its next lay_out
  int64_t blk;  // uint16 per block of K (and of V)
  // Absolute block jb (>= b0[b]) of sequence b, kv head kvh.
  const uint16_t* k_block(int64_t b, int64_t kvh, int64_t jb) const {
    return K0 + (base[b] + kvh * nb[b] + jb - b0[b]) * blk;
  }
  const uint16_t* v_block(int64_t b, int64_t kvh, int64_t jb) const {
    return V0 + (base[b] + kvh * nb[b] + jb - b0[b]) * blk;
  }
};

inline Layout lay_out(const uint16_t* kc, const uint16_t* vc, const int64_t* block_tables, const int64_t* seq_lens,
                      const int64_t* qsl, int64_t B, int64_t KVH, int64_t D, int64_t BS, int64_t W, int64_t window) {
  const int64_t row = KVH * D, block_stride = BS * row;
  Layout L;
  L.blk = kBlock * D;
  L.nb.resize(B);
  L.b0.resize(B);
  L.base.assign(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    // the block of the first key the sequence's first row of this step sees
    L.b0[b] = window_first(seq_lens[b] - (qsl[b + 1] - qsl[b]) + 1, window) / kBlock;
    L.nb[b] = (seq_lens[b] + kBlock - 1) / kBlock - L.b0[b];
    L.base[b + 1] = L.base[b] + L.nb[b] * KVH;
  }
  const std::vector<int64_t>& nb = L.nb;
  const std::vector<int64_t>& b0 = L.b0;
  const std::vector<int64_t>& base = L.base;
  const int64_t blk = L.blk;
  // Reused from call to call (every element below is written before it is read): no allocation, no zeroing.
  thread_local std::vector<uint16_t> kr, vt;
  const size_t n = static_cast<size_t>(base[B] * blk) + 32;
  if (kr.size() < n) kr.resize(n);
  if (vt.size() < n) vt.resize(n);
  L.K0 = align64_in(kr);
  L.V0 = align64_in(vt);
  uint16_t* K0 = L.K0;
  uint16_t* V0 = L.V0;
  auto cache_row = [&](int64_t b, int64_t j, int64_t kvh) {  // offset of key j's row (kv head kvh) in a cache
    return block_tables[b * W + j / BS] * block_stride + (j % BS) * row + kvh * D;
  };
  at::parallel_for(0, base[B], 4, [&](int64_t i0, int64_t i1) {  // one 32-key block at a time
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = std::upper_bound(base.begin(), base.end(), i) - base.begin() - 1;
      const int64_t x = i - base[b], kvh = x / nb[b], j0 = (b0[b] + x % nb[b]) * kBlock, S = seq_lens[b];
      uint16_t* kd = K0 + i * blk;
      uint16_t* vd = V0 + i * blk;
      // The block's 32 cache rows (this kv head's part; null past the sequence's last key).
      const uint16_t* krow[kBlock];
      const uint16_t* vrow[kBlock];
      for (int64_t t = 0; t < kBlock; ++t) {
        const int64_t j = j0 + t;
        const int64_t off = j < S ? cache_row(b, j, kvh) : -1;
        krow[t] = off >= 0 ? kc + off : nullptr;
        vrow[t] = off >= 0 ? vc + off : nullptr;
      }
      for (int64_t t = 0; t < kBlock; ++t) {  // K rows as they are (D % 32 == 0: 64-byte pieces)
        for (int64_t d = 0; d < D; d += 32)
          _mm512_storeu_si512(kd + t * D + d, krow[t] ? _mm512_loadu_si512(krow[t] + d) : _mm512_setzero_si512());
      }
      // V^T, 16 d at a time: keys (2 u, 2 u + 1) interleaved into (d) pairs, the 16 x 16 matrix of pairs [u][d]
      // transposed to [d][u] = one 32-key row of V^T per register.
      const __m512i pair_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                               6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const int64_t c = d0 & ~int64_t{31};
        __m512i r[16];
        _Pragma("GCC unroll 16")
        for (int u = 0; u < 16; ++u) {
          const uint16_t *v0 = vrow[2 * u], *v1 = vrow[2 * u + 1];
          const __m512i x = v0 ? _mm512_loadu_si512(v0 + c) : _mm512_setzero_si512();
          const __m512i y = v1 ? _mm512_loadu_si512(v1 + c) : _mm512_setzero_si512();
          r[u] = _mm512_permutex2var_epi16(x, d0 % 32 == 0 ? pair_lo : pair_hi, y);
        }
        transpose16(r);
        _Pragma("GCC unroll 16")
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(vd + (d0 + i) * kBlock, r[i]);
      }
    }
  });
  return L;
}

// The 16 query vectors m0 .. m0 + nv - 1 of a tile as qT [d / 2][16] (d, d + 1) pairs, each one's context length
// in ctx_l and the first key it sees in lo_l. Padding lanes: a vector of zeros that sees the first key of the tile's
// first vector (finite everywhere, never written out).
inline void load_vectors(const uint16_t* q, int64_t qs, const RowTile& tile, int64_t m0, int64_t nv, int64_t group,
                         int64_t D, uint32_t* qT, int32_t* ctx_l, int32_t* lo_l) {
  const uint16_t* qv[16];
  const int64_t lo0 = tile.lo(m0 / group);
  for (int64_t v = 0; v < 16; ++v) {
    const int64_t m = m0 + v;
    qv[v] = v < nv ? q + tile.row(m / group) * qs + (tile.kvh * group + m % group) * D : nullptr;
    ctx_l[v] = v < nv ? static_cast<int32_t>(tile.first + m / group + 1) : static_cast<int32_t>(lo0 + 1);
    lo_l[v] = static_cast<int32_t>(v < nv ? tile.lo(m / group) : lo0);
  }
  if (D % 32 == 0) {  // 16 pairs of each vector per register, transposed
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
      __m512i r[16];
      _Pragma("GCC unroll 16")
      for (int v = 0; v < 16; ++v) r[v] = qv[v] ? _mm512_loadu_si512(qv[v] + 2 * p0) : _mm512_setzero_si512();
      transpose16(r);
      _Pragma("GCC unroll 16")
      for (int i = 0; i < 16; ++i) _mm512_store_si512(qT + (p0 + i) * 16, r[i]);
    }
    return;
  }
  for (int64_t v = 0; v < 16; ++v) {
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(qv[v]);
    for (int64_t p = 0; p < D / 2; ++p) qT[p * 16 + v] = qr ? qr[p] : 0;
  }
}

// One block's online softmax step for 16 vectors: sT [32 keys][16 vectors] raw scores of the block at key j0, scv
// the score scale times log2 e; masked: some lane does not see some key of the block (key j visible to a lane where
// lo <= j < ctx). Updates the running max mv and sum lv, writes P^T as bf16 (key 2 t, 2 t + 1) pairs to pT [16][16],
// sets grew (the lanes whose max grew) and returns each lane's alpha = e^(m_old - m_new). A lane that has seen no key
// yet keeps mv = -inf, lv = 0 and (alpha = 0, P = 0) its zero output.
// Two passes over sT (in L1) rather than the block's 32 scaled score vectors held in registers (which spilled), and
// the masks only in the blocks that need them (kMasked): the same operations on each value, so the same bits.
template <bool kMasked>
inline __m512 softmax_block_t(const float* sT, __m512i ctx, __m512i lo, int64_t j0, __m512 scv, __m512& mv,
                              __m512& lv, uint32_t* pT, __mmask16& grew) {
  const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                            21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  auto visible = [&](int64_t j) {
    const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(j0 + j));
    return _mm512_mask_cmple_epi32_mask(_mm512_cmpgt_epi32_mask(ctx, key), lo, key);
  };
  // The block's max of the raw scores (four independent chains: max is exact, so the order does not matter), then
  // scaled: s -> s * scv rounds monotonically (scv > 0), so this is the max of the scaled scores.
  __m512 bm[4] = {ninf, ninf, ninf, ninf};
  _Pragma("GCC unroll 32")
  for (int64_t j = 0; j < kBlock; ++j) {
    __m512 s = _mm512_load_ps(sT + j * 16);
    if constexpr (kMasked) s = _mm512_mask_blend_ps(visible(j), ninf, s);
    bm[j % 4] = _mm512_max_ps(bm[j % 4], s);
  }
  const __m512 bmax = _mm512_mul_ps(_mm512_max_ps(_mm512_max_ps(bm[0], bm[1]), _mm512_max_ps(bm[2], bm[3])), scv);
  const __m512 mnew = _mm512_max_ps(mv, bmax);
  grew = _mm512_cmp_ps_mask(mnew, mv, _CMP_NEQ_OQ);
  // 1.0 exactly where the max did not grow (2^0); the first block's mv is -inf: clamped, 2^-200 = 0
  const __m512 alpha = exp2_16(_mm512_max_ps(_mm512_sub_ps(mv, mnew), _mm512_set1_ps(-200.f)));
  __m512 psum = _mm512_setzero_ps();
  _Pragma("GCC unroll 16")
  for (int64_t t = 0; t < kBlock / 2; ++t) {
    // pinned: the scaled score rounded before the subtraction (no FMA of the two), as in the max above
    const __m512 s0 = pinned(_mm512_mul_ps(_mm512_load_ps(sT + 2 * t * 16), scv));
    const __m512 s1 = pinned(_mm512_mul_ps(_mm512_load_ps(sT + (2 * t + 1) * 16), scv));
    __m512 p0 = exp2_16(_mm512_sub_ps(s0, mnew)), p1 = exp2_16(_mm512_sub_ps(s1, mnew));
    if constexpr (kMasked) {  // keys a lane does not see: 0 (in a lane that has seen none, mnew = -inf: not finite)
      p0 = _mm512_maskz_mov_ps(visible(2 * t), p0);
      p1 = _mm512_maskz_mov_ps(visible(2 * t + 1), p1);
    }
    psum = _mm512_add_ps(psum, _mm512_add_ps(p0, p1));
    _mm512_store_si512(pT + t * 16, _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
  }
  lv = _mm512_fmadd_ps(lv, alpha, psum);
  mv = mnew;
  return alpha;
}
inline __m512 softmax_block(const float* sT, __m512i ctx, __m512i lo, int64_t j0, bool masked, __m512 scv, __m512& mv,
                            __m512& lv, uint32_t* pT, __mmask16& grew) {
  return masked ? softmax_block_t<true>(sT, ctx, lo, j0, scv, mv, lv, pT, grew)
                : softmax_block_t<false>(sT, ctx, lo, j0, scv, mv, lv, pT, grew);
}

// Vector m0 + v's output (v < nv): column v of O^T (acc [D][16]) times 1 / its sum, 16 d at a time transposed in
// registers.
inline void write_vectors(const float* acc, __m512 lv, const RowTile& tile, int64_t m0, int64_t nv, int64_t group,
                          int64_t H, int64_t D, uint16_t* out) {
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), lv);
  uint16_t* o[16];
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t m = m0 + v;
    o[v] = out + (tile.row(m / group) * H + tile.kvh * group + m % group) * D;
  }
  for (int64_t d0 = 0; d0 < D; d0 += 16) {  // D % 16 == 0 (checked by the caller)
    __m512i r[16];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 16; ++i) r[i] = (__m512i)_mm512_mul_ps(_mm512_load_ps(acc + (d0 + i) * 16), inv);
    transpose16(r);
    for (int64_t v = 0; v < nv; ++v) store16(o[v] + d0, (__m512)r[v]);
  }
}

// S^T of 16 keys (K rows kd, row stride D) x the 16 vectors of qT into dst [16][16]: one vdpbf16ps chain per key
// over the d pairs in order, the key's pair broadcast from memory.
inline void scores16(const uint16_t* kd, const uint32_t* qT, int64_t D, float* dst) {
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(kd);
  __m512 s[16];
  _Pragma("GCC unroll 16")
  for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    const __m512bh qv = (__m512bh)_mm512_load_si512(qT + p * 16);
    _Pragma("GCC unroll 16")
    for (int j = 0; j < 16; ++j)
      s[j] = dpbf16_bcast(s[j], k32 + j * (D / 2) + p, qv);
  }
  _Pragma("GCC unroll 16")
  for (int j = 0; j < 16; ++j) _mm512_store_ps(dst + j * 16, s[j]);
}

// acc + the pair dot products of w with the pair at byte Off of base broadcast to every lane (dpbf16_bcast with the
// offset a constant of the instruction: GCC computes a separate address register for each of dpbf16_bcast's memory
// operands, ~90 register moves and address computations per 256 dot products in pv16, where here one base register
// serves them all). N: the bytes read from base, for the compiler's dependence on them.
template <int Off, int N>
__attribute__((always_inline)) inline __m512 dpbf16_at(__m512 acc, const void* base, __m512bh w) {
  struct Bytes {
    char b[N];
  };
  asm("vdpbf16ps %c[off](%[base])%{1to16%}, %[w], %[acc]"
      : [acc] "+v"(acc)
      : [base] "r"(base), [off] "i"(Off), [w] "v"(w), "m"(*static_cast<const Bytes*>(base)));
  return acc;
}
// Key pair t of pv16: a[i] += V^T[d0 + i][pair t] . P^T[pair t] for the 16 d (v32: V^T row d0, 16 uint32 per row).
template <int T, int... I>
__attribute__((always_inline)) inline void pv16_pair(__m512* a, const uint32_t* v32, const uint32_t* pT,
                                                     std::integer_sequence<int, I...>) {
  const __m512bh pv = (__m512bh)_mm512_load_si512(pT + T * 16);
  ((a[I] = dpbf16_at<(I * (kBlock / 2) + T) * 4, 16 * kBlock * 2>(a[I], v32, pv)), ...);
}
template <int... T>
__attribute__((always_inline)) inline void pv16_pairs(__m512* a, const uint32_t* v32, const uint32_t* pT,
                                                      std::integer_sequence<int, T...>) {
  (pv16_pair<T>(a, v32, pT, std::make_integer_sequence<int, 16>{}), ...);
}

// O^T rows d0 .. d0 + 15 (acc [D][16]) times alpha where some lane's max grew, then += V^T P^T over the block's 16 key
// pairs (V^T block vd [D][32 keys], so (key 2 t, 2 t + 1) of one d is one uint32, broadcast from memory).
inline void pv16(const uint16_t* vd, const uint32_t* pT, int64_t d0, bool scale, __m512 alpha, float* acc) {
  __m512 a[16];
  _Pragma("GCC unroll 16")
  for (int i = 0; i < 16; ++i) {
    a[i] = _mm512_load_ps(acc + (d0 + i) * 16);
    if (scale) a[i] = _mm512_mul_ps(a[i], alpha);
  }
  static_assert(kBlock == 32);
  pv16_pairs(a, reinterpret_cast<const uint32_t*>(vd) + d0 * (kBlock / 2), pT, std::make_integer_sequence<int, 16>{});
  _Pragma("GCC unroll 16")
  for (int i = 0; i < 16; ++i) _mm512_store_ps(acc + (d0 + i) * 16, a[i]);
}

void run(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, const int64_t* block_tables,
         const int64_t* seq_lens, const int64_t* qsl, const int64_t* rows, uint16_t* out, int64_t B, int64_t H,
         int64_t KVH, int64_t D, int64_t BS, int64_t W, float scale, int64_t window) {
  const int64_t group = H / KVH;
  const Layout L = lay_out(kc, vc, block_tables, seq_lens, qsl, B, KVH, D, BS, W, window);
  const auto items = work_items(qsl, seq_lens, B, KVH);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n_items);
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {  // each thread takes items from `next`
    alignas(64) uint32_t qT[(256 / 2) * 16];
    alignas(64) float sT[kBlock * 16];
    alignas(64) uint32_t pT[16 * 16];
    alignas(64) float acc[256 * 16];
    alignas(64) int32_t ctx_l[16], lo_l[16];
    const __m512 scv = _mm512_set1_ps(scale * 1.4426950408889634f);  // scores in log2 units
    for (int64_t it = next.fetch_add(1); it < n_items; it = next.fetch_add(1)) {  // until no item is left
      const RowTile tile(items[it], qsl, seq_lens, group, rows, window);
      const int64_t first = tile.first, M = tile.M;
      for (int64_t m0 = 0; m0 < M; m0 += 16) {  // 16 query vectors at a time
        const int64_t nv = std::min<int64_t>(16, M - m0);
        load_vectors(q, qs, tile, m0, nv, group, D, qT, ctx_l, lo_l);
        const __m512i ctx = _mm512_load_si512(ctx_l), lo = _mm512_load_si512(lo_l);
        const int64_t cmin = ctx_l[0], cmax = first + (m0 + nv - 1) / group + 1;
        const int64_t lmin = lo_l[0], lmax = tile.lo((m0 + nv - 1) / group);
        __m512 mv = _mm512_set1_ps(-INFINITY), lv = _mm512_setzero_ps();
        std::memset(acc, 0, D * 16 * sizeof(float));
        // Blocks from the one holding the first key any of the vectors sees (earlier ones would leave every lane
        // unchanged: a row's bits do not depend on where its tile starts).
        const int64_t nblk = (cmax + kBlock - 1) / kBlock;
        for (int64_t jb = lmin / kBlock; jb < nblk; ++jb) {
          const int64_t j0 = jb * kBlock;
          const uint16_t* kd = L.k_block(tile.b, tile.kvh, jb);
          scores16(kd, qT, D, sT);
          scores16(kd + 16 * D, qT, D, sT + 16 * 16);
          __mmask16 grew;
          const bool masked = j0 + kBlock > cmin || j0 < lmax;
          const __m512 alpha = softmax_block(sT, ctx, lo, j0, masked, scv, mv, lv, pT, grew);
          const bool rescale = jb > lmin / kBlock && grew;
          for (int64_t d0 = 0; d0 < D; d0 += 16) pv16(L.v_block(tile.b, tile.kvh, jb), pT, d0, rescale, alpha, acc);
        }
        write_vectors(acc, lv, tile, m0, nv, group, H, D, out);
      }
    }
  });
}

}  // namespace rows_bf16

#ifdef PAGEDSERVE_AMX
// The same row kernel on AMX tiles (Sapphire Rapids and later, where amx_active(); see rows_bf16 above): the scores of
// a block are two C tiles of TDPBF16PS over the D / 32 chunks of d (qT is one B tile per chunk, K rows two A tiles);
// P^T is a B tile and O^T += V^T P^T one TDPBF16PS per 16 d. For D = 64 the four O^T tiles stay in tile registers
// across blocks; when some vector's max grows they are stored, scaled by each vector's alpha (1.0 exactly for the
// others) and reloaded. Other D keep O^T in memory: acc = acc * alpha + P.V per block.
namespace rows_amx {
using rows_bf16::kBlock;
using rows_bf16::RowTile;

void run(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, const int64_t* block_tables,
         const int64_t* seq_lens, const int64_t* qsl, const int64_t* rows, uint16_t* out, int64_t B, int64_t H,
         int64_t KVH, int64_t D, int64_t BS, int64_t W, float scale, int64_t window) {
  const int64_t group = H / KVH;
  const rows_bf16::Layout L = rows_bf16::lay_out(kc, vc, block_tables, seq_lens, qsl, B, KVH, D, BS, W, window);
  const auto items = rows_bf16::work_items(qsl, seq_lens, B, KVH);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n_items);
  const bool resident = D == 64;  // O^T in tiles 0-3 across blocks
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {  // each thread takes items from `next`
    alignas(64) uint32_t qT[(256 / 2) * 16];
    alignas(64) float sT2[2][kBlock * 16];
    alignas(64) uint32_t pT[16 * 16];
    alignas(64) float pv[256 * 16];
    alignas(64) float acc[256 * 16];
    alignas(64) int32_t ctx_l[16], lo_l[16];
    // Scores in log2 units (scale * log2 e folded in), so that e^(s - m) is exp2_16 of their difference.
    const __m512 scv = _mm512_set1_ps(scale * 1.4426950408889634f);
    amx::Tiles tiles;
    tiles.use(16);
    for (int64_t it = next.fetch_add(1); it < n_items; it = next.fetch_add(1)) {  // until no item is left
      const RowTile tile(items[it], qsl, seq_lens, group, rows, window);
      const int64_t first = tile.first, M = tile.M;
      for (int64_t m0 = 0; m0 < M; m0 += 16) {  // one tile of 16 query vectors
        const int64_t nv = std::min<int64_t>(16, M - m0);
        rows_bf16::load_vectors(q, qs, tile, m0, nv, group, D, qT, ctx_l, lo_l);
        const __m512i ctx = _mm512_load_si512(ctx_l), lo = _mm512_load_si512(lo_l);
        const int64_t cmin = ctx_l[0], cmax = first + (m0 + nv - 1) / group + 1;
        const int64_t lmin = lo_l[0], lmax = tile.lo((m0 + nv - 1) / group), jb0 = lmin / kBlock;
        __m512 mv = _mm512_set1_ps(-INFINITY), lv = _mm512_setzero_ps();
        if (resident) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        }
        // S^T of block jb: keys 0-15 (tile 4) and 16-31 (tile 5) x 16 vectors, into dst.
        auto scores = [&](int64_t jb, float* dst) {
          const uint16_t* kd = L.k_block(tile.b, tile.kvh, jb);
          _tile_zero(4);
          _tile_zero(5);
          for (int64_t c = 0; c < D / 32; ++c) {
            _tile_loadd(7, qT + c * 16 * 16, 64);
            _tile_loadd(6, kd + c * 32, D * 2);
            _tile_dpbf16ps(4, 6, 7);
            _tile_loadd(6, kd + 16 * D + c * 32, D * 2);
            _tile_dpbf16ps(5, 6, 7);
          }
          _tile_stored(4, dst, 64);
          _tile_stored(5, dst + 16 * 16, 64);
        };
        // One block ahead: the next block's S^T tiles are issued before this block's softmax (which reads the
        // other sT buffer), so the AMX work and the AVX-512 softmax overlap instead of taking turns (tiles are
        // not renamed: in program order S(jb + 1) waits for P.V(jb - 1) only, and softmax(jb) for nothing).
        // From the block of the first key any of the vectors sees, as in rows_bf16::run.
        const int64_t nblk = (cmax + kBlock - 1) / kBlock;
        scores(jb0, sT2[jb0 & 1]);
        for (int64_t jb = jb0; jb < nblk; ++jb) {
          const int64_t j0 = jb * kBlock;
          const uint16_t* vd = L.v_block(tile.b, tile.kvh, jb);
          if (jb + 1 < nblk) scores(jb + 1, sT2[(jb + 1) & 1]);
          __mmask16 grew;
          const bool masked = j0 + kBlock > cmin || j0 < lmax;
          const __m512 alpha = rows_bf16::softmax_block(sT2[jb & 1], ctx, lo, j0, masked, scv, mv, lv, pT, grew);
          _tile_loadd(7, pT, 64);
          if (resident) {
            if (jb > jb0 && grew) {  // rescale O^T: every vector by its alpha
              _tile_stored(0, acc, 64);
              _tile_stored(1, acc + 256, 64);
              _tile_stored(2, acc + 512, 64);
              _tile_stored(3, acc + 768, 64);
              for (int64_t d = 0; d < 64; ++d) _mm512_store_ps(acc + d * 16, _mm512_mul_ps(_mm512_load_ps(acc + d * 16), alpha));
              _tile_loadd(0, acc, 64);
              _tile_loadd(1, acc + 256, 64);
              _tile_loadd(2, acc + 512, 64);
              _tile_loadd(3, acc + 768, 64);
            }
            _tile_loadd(6, vd, 64);
            _tile_dpbf16ps(0, 6, 7);
            _tile_loadd(6, vd + 16 * kBlock, 64);
            _tile_dpbf16ps(1, 6, 7);
            _tile_loadd(6, vd + 32 * kBlock, 64);
            _tile_dpbf16ps(2, 6, 7);
            _tile_loadd(6, vd + 48 * kBlock, 64);
            _tile_dpbf16ps(3, 6, 7);
          } else {
            for (int64_t u = 0; u < D / 16; ++u) {
              _tile_zero(0);
              _tile_loadd(6, vd + u * 16 * kBlock, 64);
              _tile_dpbf16ps(0, 6, 7);
              _tile_stored(0, pv + u * 256, 64);
            }
            if (jb == jb0) {
              std::memcpy(acc, pv, D * 16 * 4);
            } else {
              for (int64_t d = 0; d < D; ++d)
                _mm512_store_ps(acc + d * 16, _mm512_fmadd_ps(_mm512_load_ps(acc + d * 16), alpha, _mm512_load_ps(pv + d * 16)));
            }
          }
        }
        if (resident) {
          _tile_stored(0, acc, 64);
          _tile_stored(1, acc + 256, 64);
          _tile_stored(2, acc + 512, 64);
          _tile_stored(3, acc + 768, 64);
        }
        rows_bf16::write_vectors(acc, lv, tile, m0, nv, group, H, D, out);
      }
    }
  });
}

}  // namespace rows_amx
#endif
}  // namespace pagedserve
#endif

namespace pagedserve {

namespace {
// Both entry points below. rows: null, or [T'] int64 (row i of the call is q[rows[i]], written to (*out)[rows[i]]).
torch::Tensor rows_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                             const torch::Tensor& query_start_loc, double scale, int64_t window,
                             const torch::Tensor* rows, torch::Tensor* out) {
  TORCH_CHECK(window >= 0, "paged_attention_rows: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention_rows: q must be [T, H, D] with contiguous heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention_rows: caches must be contiguous [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous() &&
                  query_start_loc.scalar_type() == torch::kInt64 && query_start_loc.is_contiguous(),
              "paged_attention_rows: block_tables, seq_lens and query_start_loc must be contiguous int64");
  const int64_t B = block_tables.size(0), W = block_tables.size(1), H = q.size(1), D = q.size(2);
  const int64_t T = rows ? rows->numel() : q.size(0);
  const int64_t* rw = nullptr;
  if (rows) {
    TORCH_CHECK(rows->scalar_type() == torch::kInt64 && rows->dim() == 1 && rows->is_contiguous(),
                "paged_attention_rows_into: rows must be a contiguous 1-D int64 tensor");
    TORCH_CHECK(out->is_contiguous() && out->sizes() == q.sizes() && out->scalar_type() == q.scalar_type(),
                "paged_attention_rows_into: out must be contiguous, shaped and typed like q");
    rw = rows->data_ptr<int64_t>();
    std::vector<bool> seen(q.size(0), false);  // distinct rows: no two tiles may write one output row
    for (int64_t i = 0; i < T; ++i) {
      TORCH_CHECK(rw[i] >= 0 && rw[i] < q.size(0) && !seen[rw[i]], "paged_attention_rows_into: bad row ", rw[i]);
      seen[rw[i]] = true;
    }
  }
  const int64_t KVH = k_cache.size(2), BS = k_cache.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D, "paged_attention_rows: head shapes do not match");
  TORCH_CHECK(seq_lens.numel() == B && query_start_loc.numel() == B + 1, "paged_attention_rows: one entry per sequence");
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == T, "paged_attention_rows: query_start_loc must run from 0 to T");
  for (int64_t b = 0; b < B; ++b) {  // a bad table must raise, never read outside the cache
    const int64_t ql = qsl[b + 1] - qsl[b];
    TORCH_CHECK(ql >= 1 && sl[b] >= ql && sl[b] <= W * BS, "paged_attention_rows: bad lengths for sequence ", b);
    for (int64_t j = 0; j < (sl[b] + BS - 1) / BS; ++j) {
      const int64_t id = bt[b * W + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention_rows: block id ", id, " is outside the cache");
    }
  }
#ifdef PAGEDSERVE_ROWS_BF16
  if (q.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16 && D % 32 == 0 && D <= 256) {
    auto res = rows ? *out : torch::empty({T, H, D}, q.options().memory_format(torch::MemoryFormat::Contiguous));
    auto* run = rows_bf16::run;
#ifdef PAGEDSERVE_AMX
    if (amx_active()) run = rows_amx::run;
#endif
    run(ptr<uint16_t>(q), q.stride(0), ptr<uint16_t>(k_cache), ptr<uint16_t>(v_cache), bt, sl, qsl, rw,
        ptr<uint16_t>(res), B, H, KVH, D, BS, W, static_cast<float>(scale), window);
    return res;
  }
#endif
  const float sc = static_cast<float>(scale);
  const bool f32 = q.scalar_type() == torch::kFloat32;
  if (D % 16 == 0 && (f32 || !rows)) {  // the tiled kernel: q read with its row stride, rows written in place
    const torch::Tensor qf = f32 ? q : q.to(torch::kFloat32).contiguous();
    auto res = rows ? *out : torch::empty({T, H, D}, qf.options().memory_format(torch::MemoryFormat::Contiguous));
    dispatch_float_bf16(k_cache, "paged_attention_rows", [&]<typename S>() {
      strict::rows_kernel_tiled<S>(qf.data_ptr<float>(), qf.stride(0), rw, ptr<S>(k_cache), ptr<S>(v_cache), bt, sl,
                                   qsl, res.data_ptr<float>(), B, H, KVH, D, BS, W, sc, window);
    });
    return f32 ? res : res.to(q.scalar_type());
  }
  if (rows) {  // the other routes: gather the rows, run them in order, scatter the result
    auto res = rows_attention(q.index_select(0, *rows), k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                              scale, window, nullptr, nullptr);
    out->index_copy_(0, *rows, res);
    return *out;
  }
  auto qf = q.to(torch::kFloat32).contiguous();
  auto res = torch::empty({T, H, D}, qf.options());
  if (k_cache.scalar_type() == torch::kFloat32) {
    strict::rows_kernel<float>(qf.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt, sl, qsl,
                               res.data_ptr<float>(), B, H, KVH, D, BS, W, sc, window);
  } else if (k_cache.scalar_type() == torch::kBFloat16) {
    strict::rows_kernel<c10::BFloat16>(qf.data_ptr<float>(), k_cache.data_ptr<c10::BFloat16>(),
                                       v_cache.data_ptr<c10::BFloat16>(), bt, sl, qsl, res.data_ptr<float>(), B, H,
                                       KVH, D, BS, W, sc, window);
  } else {
    TORCH_CHECK(false, "paged_attention_rows: cache dtype must be float32 or bfloat16");
  }
  return f32 ? res : res.to(q.scalar_type());
}
}  // namespace

// The strict mode's attention (see strict::rows_kernel). q: [T, H, D] (float32 or bf16, heads
// contiguous), caches as paged_decode_attention's, block_tables [B, W], seq_lens [B] (context after this
// step), query_start_loc [B + 1] (sequence b's rows are q[qsl[b]:qsl[b+1]]); window > 0: a sliding window, each
// row sees its last `window` positions (itself included) only. Returns [T, H, D] in q's dtype.
torch::Tensor paged_attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                                   double scale, int64_t window) {
  return rows_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, nullptr, nullptr);
}

// The same for the rows q[rows[i]] (i < T'; query_start_loc runs from 0 to T'), each written to out[rows[i]] (out
// [T, H, D] contiguous, q's dtype; other rows untouched): a step's prefill rows among its decode rows without gathering
// them into a copy of q and scattering the result back.
void paged_attention_rows_into(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                               torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor rows,
                               torch::Tensor out, double scale, int64_t window) {
  rows_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, &rows, &out);
}

}  // namespace pagedserve
