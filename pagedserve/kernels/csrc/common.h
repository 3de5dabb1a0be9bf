// Shared helpers of pagedserve's CPU kernels: element loads/stores for float32 and bfloat16 storage.
//
// bf16 is handled as its raw 16 bits (uint16_t) so that plain loops vectorize: a bf16 value is the top
// half of a float32, and rounding back is round-to-nearest-even on the dropped half (as PyTorch does).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_AVX512 1
#elif defined(__AVX2__)
#include <immintrin.h>
#endif
// The quantized matmuls' AVX2 kernels (quant_gemm.cpp: the float32 route's GEMV and widening, the int8 route's AVX2
// form); DecodeStack's team takes the float32 route where they are built.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_QUANT_AVX2 1
#endif

namespace pagedserve {

// The team's meeting point between ops: a counting barrier the threads spin on (the step's ops are microseconds
// apart), yielding the core after a while of it (more threads than cores: a waiter must not keep the one it waits for
// off its core). abort() releases every waiter for good: a thread whose op raised stops the others instead of leaving
// them waiting; wait() then returns false.
class TeamBarrier {
 public:
  explicit TeamBarrier(int64_t n) : n_(n) {}
  bool wait() {
    const int64_t g = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
    } else {
      for (int64_t spins = 0; gen_.load(std::memory_order_acquire) == g && !aborted_.load(std::memory_order_acquire);
           ++spins) {
        if (spins < kSpins) {
          _mm_pause();
        } else {
          std::this_thread::yield();
        }
      }
    }
    return !aborted_.load(std::memory_order_acquire);
  }
  void abort() { aborted_.store(true, std::memory_order_release); }

 private:
  static constexpr int64_t kSpins = 4096;  // ~50 us of pauses
  const int64_t n_;
  std::atomic<int64_t> count_{0}, gen_{0};
  std::atomic<bool> aborted_{false};
};

// A decode step's team (decode_stack.cpp): DecodeStack runs a step of a few sequences in ONE parallel region whose
// threads meet at a barrier between its ops, instead of forking a parallel region per op (~150 per step of a 30-layer
// model, ~2 us each, with the second thread idle between them). Inside it a thread sets its place here around a kernel
// that splits work: team_for then runs this thread's share of the range instead of forking (an item's result does not
// depend on which thread computes it in any kernel that uses it), and matmul_output (and silu_and_mul /
// gelu_tanh_and_mul) hand out the team's shared output. Outside a team (t < 0) all behave as before.
struct Team {
  int64_t t = -1, n = 1;
  const torch::Tensor* out = nullptr;
  // For a kernel of two passes, the second reading what the first wrote on other threads (the decode attention's
  // combine of a split sequence's partitions): the team's barrier, and scratch the passes share (see team_sync).
  TeamBarrier* barrier = nullptr;
  std::vector<float>* scratch = nullptr;
  // The team's counters for claim_for (see TeamClaims); null: every member takes its fixed share.
  struct TeamClaims* claims = nullptr;
};
inline thread_local Team g_team;

// One thread's range of a claimed call (claim_ranges), on a cache line of its own: how many items its owner has
// taken from its front (low 32 bits) and the others from its back (high 32 bits).
struct alignas(64) ClaimCounter {
  std::atomic<uint64_t> taken{0};
};

// One member's view of the counters a team's step shares, zero at its start: the k-th claim_for call of each member
// (every member makes the same calls in the same order) claims from counters[k * stride ..], one per member (stride:
// at least the team's size). Past `size` calls the members take their fixed shares (team_for).
struct TeamClaims {
  ClaimCounter* counters = nullptr;
  int64_t size = 0, stride = 1, next = 0;
};

// Inside such a kernel: every member of the team here (the scratch's size set by thread 0 before it, the first pass's
// results after it). A team aborted by another member's error throws.
inline void team_sync() {
  TORCH_CHECK(g_team.barrier && g_team.barrier->wait(), "decode team aborted");
}

// f(begin, end) over [0, n): this thread's share in a team, else at::parallel_for's.
template <typename F>
inline void team_for(int64_t n, int64_t grain, const F& f) {
  if (g_team.t >= 0) {
    const int64_t b = n * g_team.t / g_team.n, e = n * (g_team.t + 1) / g_team.n;
    if (b < e) f(b, e);
    return;
  }
  at::parallel_for(0, n, grain, f);
}

// f(t, threads) for each t of [0, threads), threads = min(torch's threads, n), in one parallel region (inline for
// one): the place of each worker of a kernel whose workers claim their items (claim_for, parallel_claims).
template <typename F>
inline void on_threads(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    f(0, 1);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) f(t, threads);
  });
}

// f(begin, end) over ranges that together cover [0, n) once (n < 2^31), for the t-th of `threads` callers, each
// range claimed by whichever caller is free: every caller owns a fixed share of [0, n) (team_for's) and claims it
// front first, half of what is left at a time; a caller done with its own takes half of what is left of the next
// unfinished share from its back. So a thread on a slower core takes fewer items instead of the others waiting for its
// fixed share, while on an even host each walks its own share upward in adjacent ranges, as a fixed split does: the
// stream of prefetches a kernel keeps ahead of its range runs on into its next one. (Claiming from one counter, the
// second of two threads walking down from n, made a Zen 4's vdpbf16ps GEMVs 5% slower than fixed shares: each of
// its ranges started cold and its stream ran on into what it had done.) words: one ClaimCounter per caller, zero
// before the first claim.
template <typename F>
inline void claim_ranges(ClaimCounter* words, int64_t t, int64_t threads, int64_t n, const F& f) {
  if (threads == 1) {  // nobody to share with: one range
    f(0, n);
    return;
  }
  for (int64_t k = 0; k < threads; ++k) {
    const int64_t u = (t + k) % threads, lo = n * u / threads, len = n * (u + 1) / threads - lo;
    std::atomic<uint64_t>& w = words[u].taken;
    uint64_t v = w.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(v & 0xffffffffu), back = static_cast<int64_t>(v >> 32);
      const int64_t left = len - front - back;
      if (left <= 0) break;
      const int64_t take = std::max<int64_t>(1, left / 2);
      const uint64_t to = k == 0 ? v + static_cast<uint64_t>(take) : v + (static_cast<uint64_t>(take) << 32);
      if (!w.compare_exchange_weak(v, to, std::memory_order_relaxed)) continue;  // v reloaded
      if (k == 0) {
        f(lo + front, lo + front + take);
      } else {
        f(lo + len - back - take, lo + len - back);
      }
      v = w.load(std::memory_order_relaxed);
    }
  }
}

// f(begin, end) over [0, n) split between threads by claims (claim_ranges): in a team whose step shares counters
// (Team::claims) from the next of them, else the member's fixed share; outside a team in a parallel region of its
// own. For kernels whose items' results do not depend on the thread.
template <typename F>
inline void claim_for(int64_t n, const F& f) {
  if (n <= 0) return;
  if (n >= (int64_t{1} << 31)) {  // past claim_ranges' 32-bit counts: fixed shares
    team_for(n, 1, f);
    return;
  }
  if (g_team.t >= 0) {
    TeamClaims* c = g_team.claims;
    if (c && c->next < c->size && g_team.n <= c->stride) {
      claim_ranges(c->counters + (c->next++) * c->stride, g_team.t, g_team.n, n, f);
    } else {
      team_for(n, 1, f);
    }
    return;
  }
  constexpr int64_t kOnStack = 8;  // the counters of up to 8 threads on the stack (no allocation per call)
  ClaimCounter local[kOnStack];
  const int64_t threads = at::get_num_threads();
  std::vector<ClaimCounter> more(threads > kOnStack ? threads : 0);
  ClaimCounter* words = threads > kOnStack ? more.data() : local;
  on_threads(n, [&](int64_t t, int64_t th) { claim_ranges(words, t, th, n, f); });
}

// body(next) once on each thread of a parallel region, next() handing out the items of [0, n) one at a time to
// whichever thread asks (an atomic counter; -1 when none is left), so that a thread on a slower core takes fewer
// items instead of the others waiting for its fixed share. These machines' two vCPUs are often unequal (a busy host:
// one ran an FMA loop at 50-70% of the other's rate while both ran), and a static split finishes at the slower one's
// pace. For kernels whose items' results do not depend on the thread (the same bits whichever order). Outside a team.
template <typename F>
inline void parallel_claims(int64_t n, const F& body) {
  std::atomic<int64_t> counter{0};
  const auto next = [&counter, n]() -> int64_t {
    const int64_t i = counter.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  on_threads(n, [&](int64_t, int64_t) { body(next); });
}

// A matmul's output [M, N]. One of 32 MB or more (an LM head's float32 logits over a large vocabulary: Gemma 3's
// 262,144 columns at a decode step's 128 rows are 134 MB) is beyond the largest size glibc's malloc serves from its
// heap, so each torch::empty of it is a fresh mmap whose pages fault in, zeroed, as the kernel first writes them:
// 32,768 faults and ~30 ms for those 134 MB, a fifth of the matmul, at every call. Such outputs are views of buffers
// kept per thread instead (at most kKeptOutputs, grown as needed), a buffer handed out again only once nothing holds
// the last output made from it (a caller keeping the logits, or any view of them, makes the next call take another
// buffer or a plain allocation). Every kernel using it writes all of its output.
constexpr int64_t kKeptOutputBytes = int64_t{32} << 20, kKeptOutputs = 2;

inline torch::Tensor matmul_output(int64_t M, int64_t N, const torch::TensorOptions& opt) {
  if (g_team.out) return *g_team.out;  // a team's matmul: the output its threads share (see Team)
  const int64_t bytes = M * N * static_cast<int64_t>(opt.dtype().itemsize());
  if (bytes < kKeptOutputBytes) return torch::empty({M, N}, opt);
  thread_local std::vector<torch::Tensor> kept;  // uint8 buffers; use_count() 1: no output of it alive
  torch::Tensor* buf = nullptr;
  for (auto& b : kept) {
    if (b.use_count() != 1) continue;
    if (b.numel() >= bytes) {
      buf = &b;
      break;
    }
    if (buf == nullptr) buf = &b;  // free but too small: regrown below unless a large enough one is free
  }
  if (buf == nullptr) {
    if (static_cast<int64_t>(kept.size()) >= kKeptOutputs) return torch::empty({M, N}, opt);
    buf = &kept.emplace_back();
  }
  if (!buf->defined() || buf->numel() < bytes) {
    // Grown by half again at least, so that a run of slowly growing outputs (a W1 run's mixed steps) regrows rarely.
    const int64_t size = buf->defined() ? std::max(bytes, buf->numel() * 3 / 2) : bytes;
    *buf = torch::Tensor();
    *buf = torch::empty({size}, torch::TensorOptions().dtype(torch::kUInt8));
  }
  torch::Tensor keep = *buf;  // released when the output's storage is freed
  return torch::from_blob(buf->data_ptr(), {M, N}, [keep](void*) mutable { keep = torch::Tensor(); }, opt);
}

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
  // Nearest-even; a NaN is torch's quiet NaN 0x7FC0 (c10::BFloat16): the rounding's carry would run a NaN whose top
  // payload bits are ones into the sign or exponent (0x7FFFE000, an fp16 NaN scale times q: -0.0).
  static inline uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
  }
};

// x rounded to the storage precision and widened back (identity for float32).
template <typename S>
inline float round_to(float x) {
  return Elem<S>::load(Elem<S>::store(x));
}

// The first 64-byte aligned element of v (which must hold 64 bytes more than is used).
template <typename T>
inline T* align64_in(std::vector<T>& v) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

// v resized to hold n elements from a 64-byte boundary; returns that boundary (scratch buffers of the kernels).
template <typename T>
inline T* align64(std::vector<T>& v, size_t n) {
  v.resize(n + 64 / sizeof(T));
  return align64_in(v);
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

inline bool nan_bits(float v) {  // -ffast-math lets the compiler assume v == v
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return (b & 0x7fffffffu) > 0x7f800000u;
}

#if defined(__AVX2__)
// v as it is, opaque to the optimizer: -ffast-math lets GCC reassociate and contract float arithmetic written with
// intrinsics, and how it does so depends on the code the function is inlined into. Two kernels that must give the
// same bits through one inline function (silu_and_mul and the fused SwiGLU epilogue; the int8 GEMVs of the VNNI and
// AVX2 builds) pin each intermediate with this (an empty asm that "changes" its register), so every inlining
// computes the written sequence of operations.
inline __m256 pinned(__m256 v) {
  asm("" : "+v"(v));
  return v;
}
#endif
#ifdef PAGEDSERVE_AVX512
inline __m512 pinned(__m512 v) {
  asm("" : "+v"(v));
  return v;
}
#endif

#ifdef PAGEDSERVE_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// v rounded to nearest-even bf16, as the top halves of the float32 lanes (Elem<uint16_t>::store's rounding, a NaN
// its 0x7FC0).
inline __m512i round_bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
}
inline void store16(uint16_t* p, __m512 v) {  // round to nearest even, as Elem<uint16_t>::store
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  // vcvtneps2bf16 rounds every zero, normal and infinite float32 as round_bf16_bits does (checked over all 2^32 bit
  // patterns on a Sapphire Rapids); it flushes denormals and keeps NaNs NaN, so a vector holding either (fpclass:
  // QNaN 0x01, denormal 0x20, SNaN 0x80) takes the integer rounding. ~3 micro-ops per 16 values instead of 7 (bf16
  // matmul outputs at 2,048 rows: qkv and down 5-7% faster on a Sapphire Rapids).
  if (!_mm512_fpclass_ps_mask(v, 0xA1)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    return;
  }
#endif
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits(v), 16)));
}
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_AVX512BW 1
// The first n (< 16) lanes only.
inline __m512 load16(const uint16_t* p, __mmask16 n) {
  __m256i raw = _mm256_maskz_loadu_epi16(n, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(uint16_t* p, __m512 v, __mmask16 n) {
  _mm256_mask_storeu_epi16(p, n, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits(v), 16)));
}
#endif
// round_to<uint16_t> on 16 lanes: the bf16 value, widened back to float32.
inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(round_bf16_bits(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}


// e^x for 16 lanes: 2^n * poly(r), x = n ln2 + r, |r| <= ln2 / 2; a few ulp (x clamped below at -87: e^x is 0 to
// float32 precision there), inline (the same code for every lane and row; each step pinned, see pinned()).
inline __m512 exp16(__m512 x) {
  x = pinned(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)));
  const __m512 n = pinned(_mm512_roundscale_ps(pinned(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f))),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  __m512 r = pinned(_mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  r = pinned(_mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = pinned(_mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f)));
  p = pinned(_mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f)));
  p = pinned(_mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f)));
  p = pinned(_mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f)));
  p = pinned(_mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f)));
  p = pinned(_mm512_fmadd_ps(p, pinned(_mm512_mul_ps(r, r)), pinned(_mm512_add_ps(r, _mm512_set1_ps(1.0f)))));
  return pinned(_mm512_scalef_ps(p, n));
}

// 2^x for 16 lanes of finite x (no clamp: far below -126 the result is 0 or a denormal, never NaN; a lane that is
// -inf must be masked by the caller: NaN or 0): 2^n * poly(r), n = round(x), r = x - n (exact), |r| <= 1/2,
// poly the degree-5 Taylor polynomial of 2^r (relative error ~3e-6 -- far below a bf16 rounding). Half the
// instructions of exp16: the attention kernels fold log2(e) into their score scale and use this for e^x.
// With AVX512-DQ, r comes from one vreduceps and n = x - r (exact): the same n and r as rounding first and
// subtracting (the same bits for every finite x), one micro-op fewer (2^x ~10% faster in a loop on a Sapphire Rapids).
inline __m512 exp2_16(__m512 x) {
#ifdef __AVX512DQ__
  const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(x, r);
#else
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
#endif
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) rounded to bf16, times u (g, u bf16 values as float32; the caller rounds the product): silu_and_mul's
// arithmetic, shared by the fused matmul epilogue so both give the same bits. g / (1 + e^-g) as g times the
// reciprocal (rcp14 and one Newton step: ~1 ulp of float32 before the bf16 rounding; a vdivps took ~half the
// time), e^-g capped at e^80 (the kernels are built with -ffast-math: no inf; silu ~ -0 there anyway).
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp16(pinned(_mm512_min_ps(pinned(_mm512_sub_ps(_mm512_setzero_ps(), g)), _mm512_set1_ps(80.f))));
  const __m512 den = pinned(_mm512_add_ps(_mm512_set1_ps(1.f), e));
  const __m512 r0 = pinned(_mm512_rcp14_ps(den));
  const __m512 r = pinned(_mm512_mul_ps(r0, pinned(_mm512_fnmadd_ps(den, r0, _mm512_set1_ps(2.f)))));
  return pinned(_mm512_mul_ps(round16(pinned(_mm512_mul_ps(g, r))), u));
}
#if defined(__AVX512BF16__)
// acc + the pair dot products of w with the bf16 pair at `pair` broadcast to every lane: _mm512_dpbf16_ps(acc,
// set1_epi32(*pair), w), the same bits, with the broadcast embedded in the instruction's memory operand ({1to16}).
// Compilers emit a separate vpbroadcastd for the intrinsic form, which on Zen 4 costs ~20% of a chain of these
// (3.3 vs 2.7 G per second per core in a microbenchmark); the embedded form runs at the plain register rate.
inline __m512 dpbf16_bcast(__m512 acc, const void* pair, __m512bh w) {
  asm("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*static_cast<const uint32_t*>(pair)), "v"(w));
  return acc;
}
#endif
#endif

#ifdef PAGEDSERVE_QUANT_AVX2
// e^x for 8 lanes: exp16's steps (the same reduction and polynomial) with AVX2's rounding and 2^n made in the exponent
// bits (n in [-126, 127] after the clamp: exact), each step pinned (see pinned()).
inline __m256 exp8(__m256 x) {
  x = pinned(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)));
  const __m256 n = pinned(_mm256_round_ps(pinned(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f))),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  __m256 r = pinned(_mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  r = pinned(_mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = pinned(_mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f)));
  p = pinned(_mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f)));
  p = pinned(_mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f)));
  p = pinned(_mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f)));
  p = pinned(_mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f)));
  p = pinned(_mm256_fmadd_ps(p, pinned(_mm256_mul_ps(r, r)), pinned(_mm256_add_ps(r, _mm256_set1_ps(1.0f)))));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return pinned(_mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// silu(g) * u for 8 float32 lanes: g / (1 + e^-g) (a true division), e^-g capped at e^80 as the scalar form's, times
// u. silu_and_mul's float32 arithmetic wherever AVX2 + FMA are built, shared by quant_linear_silu's fused epilogue so
// that both give the same bits (every step pinned).
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8(pinned(_mm256_min_ps(pinned(_mm256_sub_ps(_mm256_setzero_ps(), g)), _mm256_set1_ps(80.f))));
  const __m256 den = pinned(_mm256_add_ps(_mm256_set1_ps(1.f), e));
  return pinned(_mm256_mul_ps(pinned(_mm256_div_ps(g, den)), u));
}
#endif

}  // namespace pagedserve
