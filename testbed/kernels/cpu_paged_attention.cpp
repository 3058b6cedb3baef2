// Paged attention for a CPU that reads K/V straight through the block table:
// no gathered copy, no padding, one call for every short query of a step.
//
// An item is query rows `row .. row + rows` of sequence `seq`, whose row j sits at
// position `keys - rows + j` and sees the keys up to it (a decode: rows = 1; a
// speculative verification: its token and drafts; a short prompt: rows = keys).
// A work unit is one item and some of its KV heads (all of them for an item of a
// few rows where there are items enough for the threads, so that its K/V rows
// are read whole; one KV head and a tile of kTileRows rows of a longer item): the
// rows' query vectors of those heads (grouped-query attention reads each K/V block
// once for all of them). A tile's keys go in chunks of whole blocks (kChunkKeys),
// three passes over each chunk's blocks: scores, their exponentials against the
// running maximum per query vector (online softmax: earlier chunks' sums and
// outputs rescaled when it rises), the weighted sum of V; so a tile holds at most
// rows x query heads x kChunkKeys scores, whatever its context. Where the CPU has
// AVX-512, a float32 tile of kLanesMinKeys keys or more holds its query vectors
// in lanes instead (attend_tile_lanes: one pass in steps of blocks). A unit of a few
// rows, whose cost is reading K/V, goes block by block instead (K, softmax, V),
// asking for the next block's lines a few at a time as it works, so that the
// memory and the arithmetic overlap. Units run on torch's intra-op threads
// (at::parallel_for), so torch.set_num_threads holds.
//
// float32 or bfloat16 (query, out and caches all of one type; bfloat16 values are
// widened to float32 as they are read, so every sum and the softmax run in float32,
// and outputs rounded to nearest-even as they are written). Where the CPU has
// AVX-512 BF16, bfloat16 scores are dot-pair products of Q and K as stored, and a
// prompt tile's weights are rounded to bfloat16 for dot-pair products with V, as
// torch's own bfloat16 attention rounds them; query and out need
// their last dimension contiguous, the caches to be contiguous. Rows not in any
// item are left as they are.

#include "cpu_ops.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using testbed_cpu_vec::exp_nonpositive;
#if defined(__AVX2__) && defined(__FMA__)
using testbed_cpu_vec::exp8;
using testbed_cpu_vec::hsum;
using testbed_cpu_vec::load8;
#endif
#if defined(__AVX512F__)
using testbed_cpu_vec::exp16;
#endif

// ---- Portable versions (any head_dim, any ISA) ----

using testbed_cpu_vec::BF16;

using testbed_cpu_vec::widen;

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float s[8] = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int l = 0; l < 8; ++l) s[l] += a[d + l] * widen(b[d + l]);
  }
  float t = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
  for (; d < n; ++d) t += a[d] * widen(b[d]);
  return t;
}

#if defined(__AVX2__) && defined(__FMA__)

// ---- AVX2 + FMA versions, for head_dim a multiple of 8 ----



// s[0..8) = q . k_t for 8 keys `stride` apart: one accumulator per key, then the
// eight reduced together (a transpose by pairwise adds).
template <typename T>
inline void scores8(const float* q, const T* k, int64_t stride, int64_t n, float* s) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 8; ++i) {
      a[i] = _mm256_fmadd_ps(qv, load8(k + i * stride + d), a[i]);
    }
  }
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m256 lo = _mm256_permute2f128_ps(t0, t1, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(t0, t1, 0x31);
  _mm256_storeu_ps(s, _mm256_add_ps(lo, hi));
}

template <typename T>
inline float dot8(const float* q, const T* k, int64_t n) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) {
    a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a);
  }
  return hsum(a);
}

// fn(std::integral_constant<int, R>{}, d) over columns [0, n) of a multiple of 8:
// 64 at a time (R = 8), then the rest in one call of R = (n - d) / 8 registers.
template <typename Fn>
inline void by_registers(int64_t n, Fn fn) {
  int64_t d = 0;
  for (; d + 64 <= n; d += 64) fn(std::integral_constant<int, 8>{}, d);
  switch ((n - d) / 8) {
    case 1: fn(std::integral_constant<int, 1>{}, d); break;
    case 2: fn(std::integral_constant<int, 2>{}, d); break;
    case 3: fn(std::integral_constant<int, 3>{}, d); break;
    case 4: fn(std::integral_constant<int, 4>{}, d); break;
    case 5: fn(std::integral_constant<int, 5>{}, d); break;
    case 6: fn(std::integral_constant<int, 6>{}, d); break;
    case 7: fn(std::integral_constant<int, 7>{}, d); break;
    default: break;
  }
}

// acc[0..8R) += sum_t p[t] * v_t[0..8R), the accumulators in R registers.
template <int R, typename T>
inline void accumulate_regs(float* acc, const float* p, const T* v, int64_t count,
                            int64_t stride) {
  __m256 a[R];
  for (int i = 0; i < R; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t t = 0; t < count; ++t) {
    const __m256 pt = _mm256_broadcast_ss(p + t);
    const T* vt = v + t * stride;
    for (int i = 0; i < R; ++i) a[i] = _mm256_fmadd_ps(pt, load8(vt + 8 * i), a[i]);
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

#endif

#if defined(__AVX512BF16__) && defined(__AVX512VL__)

// ---- bfloat16 scores through AVX-512 BF16 dot products, head_dim a multiple of 16 ----
// Each vdpbf16ps multiplies 16 pairs of bfloat16 (products exact in float32) and
// adds them to 8 float32 sums: no widening of K, half the instructions.

// 16 bfloat16 values as 8 pairs.
inline __m256bh load_pairs(const BF16* p) {
  return reinterpret_cast<__m256bh>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m256 dot_pairs(__m256 acc, const BF16* a, const BF16* b) {
  return _mm256_dpbf16_ps(acc, load_pairs(a), load_pairs(b));
}

// s[0..8) = scale * (q . k_t) for 8 keys `stride` apart.
inline void scores8_bf16(const BF16* q, const BF16* k, int64_t stride, int64_t n, float scale,
                         float* s) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) {
    for (int i = 0; i < 8; ++i) a[i] = dot_pairs(a[i], q + d, k + i * stride + d);
  }
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m256 lo = _mm256_permute2f128_ps(t0, t1, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(t0, t1, 0x31);
  _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale)));
}

// s[t] = scale * (q . k_t) for the `count` keys `stride` apart from `k`.
inline void scores_bf16(const BF16* q, const BF16* k, int64_t stride, int64_t count, int64_t n,
                        float scale, float* s) {
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) scores8_bf16(q, k + t * stride, stride, n, scale, s + t);
  for (; t < count; ++t) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) a = dot_pairs(a, q + d, k + t * stride + d);
    s[t] = hsum(a) * scale;
  }
}

// V rows interleaved in pairs for dot-pair products: dst[(kp * cols + c) * 2 + j] =
// row 2kp + j's column c, for the `lim` rows `stride` apart from `v` (a missing
// odd row reads as zeros).
inline void pair_rows(const BF16* v, int64_t stride, int64_t lim, int64_t cols, BF16* dst) {
  for (int64_t t = 0; t < lim; t += 2) {
    const BF16* a = v + t * stride;
    const BF16* b = t + 1 < lim ? a + stride : nullptr;
    BF16* out = dst + t * cols;  // pair t / 2 of 2 * cols values
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c));
      const __m256i y = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c))
                          : _mm256_setzero_si256();
      // unpack works within 128-bit lanes: columns 0-3 and 8-11, then 4-7 and 12-15
      const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * c),
                          _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * c + 16),
                          _mm256_permute2x128_si256(lo, hi, 0x31));
    }
    for (; c < cols; ++c) {
      out[2 * c] = a[c];
      out[2 * c + 1] = b ? b[c] : BF16(0.f);
    }
  }
}

// acc[0..8R) += the weights of `pairs` key pairs (ph: bfloat16, in pairs) times
// their paired V rows (vp, pair_stride apart).
template <int R>
inline void accumulate_pairs_regs(float* acc, const BF16* ph, const BF16* vp, int64_t pairs,
                                  int64_t pair_stride) {
  __m256 a[R];
  for (int i = 0; i < R; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t kp = 0; kp < pairs; ++kp) {
    int32_t two;
    std::memcpy(&two, ph + 2 * kp, sizeof two);
    const __m256bh pk = reinterpret_cast<__m256bh>(_mm256_set1_epi32(two));
    const BF16* vk = vp + kp * pair_stride;
    for (int i = 0; i < R; ++i) a[i] = _mm256_dpbf16_ps(a[i], pk, load_pairs(vk + 16 * i));
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

// acc[0..n) += sum_t p[t] * v_t over `lim` keys, the weights rounded to bfloat16
// (as torch's own bfloat16 attention rounds them before its product with V) and
// V paired by pair_rows (pair_stride values between pairs); n a multiple of 8.
inline void accumulate_pairs(float* acc, const float* p, int64_t lim, const BF16* vp,
                             int64_t pair_stride, int64_t n, BF16* ph) {
  int64_t t = 0;
  for (; t + 8 <= lim; t += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ph + t),
                     reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(_mm256_loadu_ps(p + t))));
  }
  for (; t < lim; ++t) ph[t] = BF16(p[t]);
  if (lim % 2 != 0) ph[lim] = BF16(0.f);
  const int64_t pairs = (lim + 1) / 2;
  by_registers(n, [&](auto regs, int64_t d) {
    accumulate_pairs_regs<decltype(regs)::value>(acc + d, ph, vp + 2 * d, pairs, pair_stride);
  });
}

constexpr bool kDotPairs = true;
#else
constexpr bool kDotPairs = false;
#endif

// s[t] = q . k_t for the `count` keys `stride` apart from `k`.
template <typename T>
inline void scores(const float* q, const T* k, int64_t stride, int64_t count, int64_t n,
                   float* s) {
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    for (; t + 8 <= count; t += 8) scores8(q, k + t * stride, stride, n, s + t);
    for (; t < count; ++t) s[t] = dot8(q, k + t * stride, n);
    return;
  }
#endif
  for (; t < count; ++t) s[t] = dot(q, k + t * stride, n);
}

// max of x[0..count).
inline float max_of(const float* x, int64_t count) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 m8 = _mm256_set1_ps(mx);
  for (; t + 8 <= count; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + t));
  float lanes[8];
  _mm256_storeu_ps(lanes, m8);
  for (float v : lanes) mx = std::max(mx, v);
#endif
  for (; t < count; ++t) mx = std::max(mx, x[t]);
  return mx;
}

// x[t] = exp(x[t] - mx) for t < count (mx at least every x[t]); returns their sum.
inline float exp_shifted(float* x, int64_t count, float mx) {
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 s8 = _mm256_setzero_ps();
  for (; t + 8 <= count; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
    _mm256_storeu_ps(x + t, e);
    s8 = _mm256_add_ps(s8, e);
  }
  sum = hsum(s8);
#endif
  for (; t < count; ++t) {
    x[t] = exp_nonpositive(x[t] - mx);
    sum += x[t];
  }
  return sum;
}

// acc[0..n) += sum_t p[t] * v_t for the `count` value rows `stride` apart from `v`.
template <typename T>
inline void accumulate(float* acc, const float* p, const T* v, int64_t count, int64_t stride,
                       int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    by_registers(n, [&](auto regs, int64_t d) {
      accumulate_regs<decltype(regs)::value>(acc + d, p, v + d, count, stride);
    });
    return;
  }
#endif
  for (int64_t t = 0; t < count; ++t) {
    const float pt = p[t];
    const T* vt = v + t * stride;
    for (int64_t i = 0; i < n; ++i) acc[i] += pt * widen(vt[i]);
  }
}

// Asks for the next block's rows of this head while the current one is worked on:
// the block table makes its address one the hardware prefetcher cannot guess.
template <typename T>
inline void prefetch_rows(const T* first, int64_t rows, int64_t stride, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int64_t t = 0; t < rows; ++t) {
    const char* row = reinterpret_cast<const char*>(first + t * stride);
    for (int64_t byte = 0; byte < n * static_cast<int64_t>(sizeof(T)); byte += 64) {
      _mm_prefetch(row + byte, _MM_HINT_T1);
    }
  }
#else
  (void)first, (void)rows, (void)stride, (void)n;
#endif
}

struct Shapes {
  int64_t heads, head_dim, block_size, kv_heads, group;
  int64_t qs0, qs1, os0, os1, key_stride, block_stride, bt_stride;
};

// Keys per chunk of a unit (rounded down to whole blocks, at least one): bounds
// the scores a unit holds; a context of a few hundred tokens is one chunk.
constexpr int64_t kChunkKeys = 1024;

// Keys per step of a unit of a few rows (rounded up to whole blocks): enough that
// folding each step's scores into the softmax costs little beside them.
constexpr int64_t kStepKeys = 32;

// Items of at most this many query rows (decodes, verifications: the rows the
// Python route, cpu_attention.NATIVE_ROWS, always sends here) may take all their
// KV heads in one unit.
constexpr int64_t kWholeRowsMaxRows = 16;

// Query rows per unit of a longer item (a prompt): with its query heads, the
// vectors whose scores over a chunk of keys a unit holds.
constexpr int64_t kTileRows = 32;

// A unit's fixed cost, in (query vector x key) pairs of one KV head, when work is
// shared out between threads.
constexpr double kUnitCostPairs = 64;

// Software prefetch of the lines a unit reads next, issued a few at a time between
// pieces of its work so that memory and arithmetic overlap (a burst of a whole
// block's lines holds the core until most of them have arrived).
class LineStream {
 public:
  // Queue `rows` rows of `row_bytes` bytes, `stride_bytes` apart, from `base`;
  // rows that touch are one span.
  void add(const void* base, int64_t rows, int64_t row_bytes, int64_t stride_bytes) {
    const char* p = static_cast<const char*>(base);
    if (row_bytes == stride_bytes) {
      if (n_ < kMaxSpans) spans_[n_++] = {p, p + rows * row_bytes};
      return;
    }
    for (int64_t t = 0; t < rows && n_ < kMaxSpans; ++t) {
      spans_[n_++] = {p + t * stride_bytes, p + t * stride_bytes + row_bytes};
    }
  }
  // Lines queued and not yet asked for.
  int64_t pending() const {
    int64_t lines = 0;
    for (int i = cur_; i < n_; ++i) lines += (spans_[i].end - spans_[i].p + 63) / 64;
    return lines;
  }
  // Ask for the next `count` queued lines (fewer where fewer are queued), into L2.
  void issue(int64_t count) {
#if defined(__AVX2__) && defined(__FMA__)
    while (count > 0 && cur_ < n_) {
      Span& g = spans_[cur_];
      const char* stop = g.p + 64 * std::min(count, (g.end - g.p + 63) / 64);
      count -= (stop - g.p) / 64;
      for (; g.p < stop; g.p += 64) _mm_prefetch(g.p, _MM_HINT_T1);
      if (g.p >= g.end) ++cur_;
    }
#else
    (void)count;
#endif
  }
  void clear() { n_ = cur_ = 0; }

 private:
  static constexpr int kMaxSpans = 256;  // two caches' rows of a block of up to 128
  struct Span {
    const char* p;
    const char* end;
  };
  Span spans_[kMaxSpans];
  int n_ = 0, cur_ = 0;
};

struct Scratch {
  std::vector<float> q, s, acc, mx, sum;
  std::vector<BF16> vp, ph;  // a V block's rows in pairs; one vector's weights
  std::vector<BF16> qh;  // bfloat16 queries unscaled, for the dot-pair scores
  std::vector<int64_t> seen;
  LineStream ahead;  // the next block's lines, for units of a few rows
  std::vector<float> qt, fv;  // lanes tiles: queries transposed; each vector's rescale
  std::vector<int32_t> lane_seen;  // lanes tiles: the keys each vector (lane) sees
};

// fn(block b's rows from head h0 on, first key t0) for each block of `cache` holding
// keys [k0, k1) (k0 at a block's start), the next block's rows of heads
// h0 .. h0 + nh prefetched meanwhile.
template <typename T, typename Fn>
inline void for_each_block(const T* cache, const int32_t* table, int64_t h0, int64_t nh,
                           int64_t k0, int64_t k1, const Shapes& sh, Fn fn) {
  const int64_t bs = sh.block_size, off = h0 * sh.head_dim;
  for (int64_t b = k0 / bs, t0 = k0; t0 < k1; ++b, t0 += bs) {
    if (t0 + bs < k1) {
      prefetch_rows(cache + static_cast<int64_t>(table[b + 1]) * sh.block_stride + off,
                    std::min(bs, k1 - t0 - bs), sh.key_stride, nh * sh.head_dim);
    }
    fn(cache + static_cast<int64_t>(table[b]) * sh.block_stride + off, t0);
  }
}

// Whether a unit's scores are dot pairs of bfloat16 queries and keys as stored
// (the CPU has them, and head_dim fills whole 16-value pairs of registers).
template <typename T>
constexpr bool dot_pair_scores(int64_t head_dim) {
  return kDotPairs && std::is_same_v<T, BF16> && head_dim % 16 == 0;
}

// Vector r of a unit of item `it` and KV heads h0 .. h0 + nh, ordered (KV head,
// row, query head of it): fn(r, the query head's first value, the row).
template <typename Fn>
inline void for_each_vector(const int64_t* it, int64_t h0, int64_t nh, const Shapes& sh, Fn fn) {
  for (int64_t hh = 0; hh < nh; ++hh) {
    for (int64_t j = 0; j < it[1]; ++j) {
      for (int64_t g = 0; g < sh.group; ++g) {
        fn((hh * it[1] + j) * sh.group + g, (h0 + hh) * sh.group + g, it[0] + j);
      }
    }
  }
}

// A unit's query vectors into w (scaled float32; bfloat16 as stored too where its
// scores are dot pairs), its sums zeroed, and the keys each vector sees; `width`
// scores held per vector. Returns the number of vectors.
template <typename T>
int64_t start_unit(const int64_t* it, int64_t h0, int64_t nh, const Shapes& sh, float scale,
                   const T* q_base, bool use_pairs, int64_t width, Scratch& w) {
  const int64_t hd = sh.head_dim, n = nh * it[1] * sh.group;
  w.q.resize(n * hd);
  if (use_pairs) w.qh.resize(n * hd);
  w.s.resize(n * width);
  w.acc.assign(n * hd, 0.f);
  w.mx.assign(n, -std::numeric_limits<float>::infinity());
  w.sum.assign(n, 0.f);
  w.seen.resize(n);
  for_each_vector(it, h0, nh, sh, [&](int64_t r, int64_t head, int64_t row) {
    const T* src = q_base + row * sh.qs0 + head * sh.qs1;
    float* dst = w.q.data() + r * hd;
    for (int64_t d = 0; d < hd; ++d) dst[d] = widen(src[d]) * scale;
    if (use_pairs) std::copy(src, src + hd, w.qh.data() + r * hd);
    w.seen[r] = it[2] - (it[0] + it[1] - row) + 1;  // the keys this row sees
  });
  return n;
}

// Online softmax: vector r's `count` new scores sr become their exponentials
// against its running maximum, what earlier keys summed rescaled where it rose.
inline void fold_scores(Scratch& w, int64_t r, float* sr, int64_t count, int64_t hd) {
  const float top = std::max(w.mx[r], max_of(sr, count));
  if (top > w.mx[r] && w.sum[r] > 0.f) {
    const float f = exp_nonpositive(w.mx[r] - top);
    w.sum[r] *= f;
    float* ar = w.acc.data() + r * hd;
    for (int64_t d = 0; d < hd; ++d) ar[d] *= f;
  }
  w.mx[r] = top;
  w.sum[r] += exp_shifted(sr, count, top);
}

// Each vector's weighted sum over its softmax's total, into out.
template <typename T>
void finish_unit(const int64_t* it, int64_t h0, int64_t nh, const Shapes& sh, T* o_base,
                 const Scratch& w) {
  const int64_t hd = sh.head_dim;
  for_each_vector(it, h0, nh, sh, [&](int64_t r, int64_t head, int64_t row) {
    const float* ar = w.acc.data() + r * hd;
    const float inv = 1.f / w.sum[r];
    T* dst = o_base + row * sh.os0 + head * sh.os1;
    for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<T>(ar[d] * inv);
  });
}

// s[0..lim) = the scores of vector r's query against `lim` keys from k.
template <typename T>
inline void unit_scores(const Scratch& w, int64_t r, const T* k, int64_t lim, const Shapes& sh,
                        bool use_pairs, float scale, float* s) {
  const int64_t hd = sh.head_dim;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  if constexpr (kDotPairs && std::is_same_v<T, BF16>) {
    if (use_pairs) {
      scores_bf16(w.qh.data() + r * hd, k, sh.key_stride, lim, hd, scale, s);
      return;
    }
  }
#endif
  (void)use_pairs, (void)scale;
  scores(w.q.data() + r * hd, k, sh.key_stride, lim, hd, s);
}

// A tile of a longer item: its keys chunk by chunk, three passes over each
// chunk's blocks: scores (each K block read once for all query vectors, from
// cache after the first), exponentials against the running maximum, then the
// weighted V rows. Its bfloat16 V blocks are paired once for all its vectors
// where the CPU has dot pairs.
template <typename T>
void attend_tile(const int64_t* it, int64_t h0, int64_t nh, const Shapes& sh, float scale,
                 const T* q_base, T* o_base, const T* k_base, const T* v_base,
                 const int32_t* tables, Scratch& w) {
  const int64_t hd = sh.head_dim, bs = sh.block_size, keys = it[2];
  const int32_t* table = tables + it[3] * sh.bt_stride;
  const int64_t per_head = it[1] * sh.group;  // query vectors of one KV head
  const int64_t chunk = std::max<int64_t>(1, kChunkKeys / bs) * bs;
  const int64_t width = std::min(chunk, (keys + bs - 1) / bs * bs);
  const bool use_pairs = dot_pair_scores<T>(hd);
  const int64_t n = start_unit(it, h0, nh, sh, scale, q_base, use_pairs, width, w);
  for (int64_t c0 = 0; c0 < keys; c0 += chunk) {
    const int64_t c1 = std::min(keys, c0 + chunk);
    for_each_block(k_base, table, h0, nh, c0, c1, sh, [&](const T* kb, int64_t t0) {
      // This block's V rows, read after the chunk's scores: asked for now, so the
      // V pass does not start on memory it has to wait for.
      prefetch_rows(v_base + (kb - k_base), std::min(bs, c1 - t0), sh.key_stride, nh * hd);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t lim = std::min(bs, w.seen[r] - t0);
        if (lim > 0) {
          unit_scores(w, r, kb + r / per_head * hd, lim, sh, use_pairs, scale,
                      w.s.data() + r * width + (t0 - c0));
        }
      }
    });
    for (int64_t r = 0; r < n; ++r) {
      const int64_t count = std::min(c1, w.seen[r]) - c0;
      if (count > 0) fold_scores(w, r, w.s.data() + r * width, count, hd);
    }
    for_each_block(v_base, table, h0, nh, c0, c1, sh, [&](const T* vb, int64_t t0) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
      // The V rows paired once for dot-pair products with all the tile's vectors'
      // weights.
      if constexpr (kDotPairs && std::is_same_v<T, BF16>) {
        if (hd % 8 == 0) {
          const int64_t lim_all = std::min(bs, c1 - t0), cols = nh * hd;
          w.vp.resize((lim_all + 1) / 2 * 2 * cols);
          w.ph.resize(bs + 1);
          pair_rows(vb, sh.key_stride, lim_all, cols, w.vp.data());
          for (int64_t r = 0; r < n; ++r) {
            const int64_t lim = std::min(bs, w.seen[r] - t0);
            if (lim <= 0) continue;
            accumulate_pairs(w.acc.data() + r * hd, w.s.data() + r * width + (t0 - c0), lim,
                             w.vp.data() + 2 * (r / per_head * hd), 2 * cols, hd, w.ph.data());
          }
          return;
        }
      }
#endif
      for (int64_t r = 0; r < n; ++r) {
        const int64_t lim = std::min(bs, w.seen[r] - t0);
        if (lim > 0) {
          accumulate(w.acc.data() + r * hd, w.s.data() + r * width + (t0 - c0),
                     vb + r / per_head * hd, lim, sh.key_stride, hd);
        }
      }
    });
  }
  finish_unit(it, h0, nh, sh, o_base, w);
}

#if defined(__AVX512F__)

// ---- float32 prompt tiles with the query vectors in lanes (AVX-512F) ----
// A tile's scaled queries are transposed once (qt[d][v]), so that one key's
// scores for 16 vectors are one register: each K value is broadcast against 16
// vectors' query values, with no horizontal sums, and 4 keys x 64 vectors of
// scores stay in registers, 16 multiply-adds for every 8 loads (a score per
// vector and key as dot products of 8 lanes: about one load per multiply-add).
// The softmax then runs down the columns of a step's scores (st[k][v]), 16
// vectors at a time, and the weighted sum keeps 4 vectors x 64 columns of V in
// registers per key.

// st[kk][16c ..] = sum_d k_kk[d] * qt[d][16c ..] for KB keys `stride` apart and VC
// groups of 16 vectors (np lanes in all).
template <int KB, int VC>
inline void lane_scores(const float* k, int64_t stride, const float* qt, int64_t np, int64_t hd,
                        float* st) {
  __m512 a[KB][VC];
  for (int kk = 0; kk < KB; ++kk) {
    for (int c = 0; c < VC; ++c) a[kk][c] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < hd; ++d) {
    __m512 q[VC];
    for (int c = 0; c < VC; ++c) q[c] = _mm512_loadu_ps(qt + d * np + 16 * c);
    testbed_cpu_vec::pin(q);
    for (int kk = 0; kk < KB; ++kk) {
      const __m512 kv = _mm512_set1_ps(k[kk * stride + d]);
      for (int c = 0; c < VC; ++c) a[kk][c] = _mm512_fmadd_ps(kv, q[c], a[kk][c]);
    }
  }
  for (int kk = 0; kk < KB; ++kk) {
    for (int c = 0; c < VC; ++c) _mm512_storeu_ps(st + kk * np + 16 * c, a[kk][c]);
  }
}

template <int KB>
inline void lane_scores_keys(const float* k, int64_t stride, const float* qt, int64_t np,
                             int64_t hd, float* st) {
  const int64_t groups = np / 16;
  int64_t c = 0;
  for (; c + 4 <= groups; c += 4) lane_scores<KB, 4>(k, stride, qt + 16 * c, np, hd, st + 16 * c);
  switch (groups - c) {
    case 1: lane_scores<KB, 1>(k, stride, qt + 16 * c, np, hd, st + 16 * c); break;
    case 2: lane_scores<KB, 2>(k, stride, qt + 16 * c, np, hd, st + 16 * c); break;
    case 3: lane_scores<KB, 3>(k, stride, qt + 16 * c, np, hd, st + 16 * c); break;
    default: break;
  }
}

// st[t][..] for `count` keys `stride` apart from k, every vector.
inline void lane_scores_rows(const float* k, int64_t stride, int64_t count, const float* qt,
                             int64_t np, int64_t hd, float* st) {
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) lane_scores_keys<4>(k + t * stride, stride, qt, np, hd, st + t * np);
  switch (count - t) {
    case 1: lane_scores_keys<1>(k + t * stride, stride, qt, np, hd, st + t * np); break;
    case 2: lane_scores_keys<2>(k + t * stride, stride, qt, np, hd, st + t * np); break;
    case 3: lane_scores_keys<3>(k + t * stride, stride, qt, np, hd, st + t * np); break;
    default: break;
  }
}

// o[vb][16r ..] += sum_t p[t][vb] * v_t[16r ..] for VB vectors (rows of o, hd apart)
// and R groups of 16 columns, over `count` V rows `stride` apart.
template <int VB, int R>
inline void lane_weighted(float* o, int64_t hd, const float* p, int64_t np, const float* v,
                          int64_t stride, int64_t count) {
  __m512 a[VB][R];
  for (int b = 0; b < VB; ++b) {
    for (int r = 0; r < R; ++r) a[b][r] = _mm512_loadu_ps(o + b * hd + 16 * r);
  }
  for (int64_t t = 0; t < count; ++t) {
    __m512 x[R];
    for (int r = 0; r < R; ++r) x[r] = _mm512_loadu_ps(v + t * stride + 16 * r);
    testbed_cpu_vec::pin(x);
    for (int b = 0; b < VB; ++b) {
      const __m512 pt = _mm512_set1_ps(p[t * np + b]);
      for (int r = 0; r < R; ++r) a[b][r] = _mm512_fmadd_ps(pt, x[r], a[b][r]);
    }
  }
  for (int b = 0; b < VB; ++b) {
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(o + b * hd + 16 * r, a[b][r]);
  }
}

template <int VB>
inline void lane_weighted_cols(float* o, int64_t hd, const float* p, int64_t np, const float* v,
                               int64_t stride, int64_t count) {
  const int64_t groups = hd / 16;
  int64_t r = 0;
  for (; r + 4 <= groups; r += 4) {
    lane_weighted<VB, 4>(o + 16 * r, hd, p, np, v + 16 * r, stride, count);
  }
  switch (groups - r) {
    case 1: lane_weighted<VB, 1>(o + 16 * r, hd, p, np, v + 16 * r, stride, count); break;
    case 2: lane_weighted<VB, 2>(o + 16 * r, hd, p, np, v + 16 * r, stride, count); break;
    case 3: lane_weighted<VB, 3>(o + 16 * r, hd, p, np, v + 16 * r, stride, count); break;
    default: break;
  }
}

// acc[v][..] += sum_t p[t][v] * v_t for the n vectors, `count` V rows from v.
inline void lane_weighted_rows(float* acc, int64_t n, int64_t hd, const float* p, int64_t np,
                               const float* v, int64_t stride, int64_t count) {
  int64_t b = 0;
  for (; b + 4 <= n; b += 4) lane_weighted_cols<4>(acc + b * hd, hd, p + b, np, v, stride, count);
  switch (n - b) {
    case 1: lane_weighted_cols<1>(acc + b * hd, hd, p + b, np, v, stride, count); break;
    case 2: lane_weighted_cols<2>(acc + b * hd, hd, p + b, np, v, stride, count); break;
    case 3: lane_weighted_cols<3>(acc + b * hd, hd, p + b, np, v, stride, count); break;
    default: break;
  }
}

// Keys a tile sees at least to take the lanes path: transposing its queries costs
// about a tenth of a tile's work on 40 keys (measured 1.1x the dot products' time
// on prompts of 20-70 tokens), and 0.86-0.94x on prompts of 1,000-2,048.
constexpr int64_t kLanesMinKeys = 128;

// Whether a tile of T over `keys` keys takes the lanes path (float32, head_dim in
// whole registers, keys enough).
template <typename T>
constexpr bool lanes_tile(int64_t head_dim, int64_t keys) {
  return std::is_same_v<T, float> && head_dim % 16 == 0 && keys >= kLanesMinKeys;
}

// A float32 tile of one KV head with its query vectors in lanes: one pass over its
// keys in steps of whole blocks (kStepKeys keys at least), each step's scores, the
// keys a vector does not see masked, their softmax folded into the running one down
// the columns, then the step's weighted V rows; the next step's blocks asked for
// meanwhile (a tile's arithmetic outlasts their arrival).
void attend_tile_lanes(const int64_t* it, int64_t h0, int64_t nh, const Shapes& sh, float scale,
                       const float* q_base, float* o_base, const float* k_base,
                       const float* v_base, const int32_t* tables, Scratch& w) {
  const int64_t hd = sh.head_dim, bs = sh.block_size, keys = it[2];
  const int32_t* table = tables + it[3] * sh.bt_stride;
  const int64_t n = nh * it[1] * sh.group, np = (n + 15) / 16 * 16;
  const int64_t step = std::max<int64_t>(1, kStepKeys / bs) * bs;
  w.qt.assign(hd * np, 0.f);
  w.s.resize(step * np);
  w.acc.assign(n * hd, 0.f);
  w.mx.assign(np, -std::numeric_limits<float>::infinity());
  w.sum.assign(np, 0.f);
  w.fv.resize(np);
  w.lane_seen.assign(np, static_cast<int32_t>(keys));  // padding lanes: zeros, every key
  int64_t first_hidden = keys;  // the first key some vector does not see
  for_each_vector(it, h0, nh, sh, [&](int64_t r, int64_t head, int64_t row) {
    const float* src = q_base + row * sh.qs0 + head * sh.qs1;
    for (int64_t d = 0; d < hd; ++d) w.qt[d * np + r] = src[d] * scale;
    const int64_t seen = it[2] - (it[0] + it[1] - row) + 1;
    w.lane_seen[r] = static_cast<int32_t>(seen);
    first_hidden = std::min(first_hidden, seen);
  });
  const auto block = [&](int64_t t0) {  // the offset of the block holding key t0
    return static_cast<int64_t>(table[t0 / bs]) * sh.block_stride + h0 * hd;
  };
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  float* st = w.s.data();
  for (int64_t s0 = 0; s0 < keys; s0 += step) {
    const int64_t s1 = std::min(keys, s0 + step), count = s1 - s0;
    for (int64_t t0 = s1; t0 < std::min(keys, s1 + step); t0 += bs) {
      const int64_t rows = std::min(bs, keys - t0);
      prefetch_rows(k_base + block(t0), rows, sh.key_stride, hd);
      prefetch_rows(v_base + block(t0), rows, sh.key_stride, hd);
    }
    for (int64_t t0 = s0; t0 < s1; t0 += bs) {
      lane_scores_rows(k_base + block(t0), sh.key_stride, std::min(bs, s1 - t0), w.qt.data(), np,
                       hd, st + (t0 - s0) * np);
    }
    for (int64_t t = std::max(s0, first_hidden); t < s1; ++t) {  // keys past a vector's own
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(t));
      for (int64_t c = 0; c < np; c += 16) {
        const __m512i seen = _mm512_loadu_si512(w.lane_seen.data() + c);
        float* row = st + (t - s0) * np + c;
        const __mmask16 hidden = _mm512_cmpge_epi32_mask(key, seen);
        _mm512_storeu_ps(row, _mm512_mask_mov_ps(_mm512_loadu_ps(row), hidden, neg_inf));
      }
    }
    bool rose = false;
    for (int64_t c = 0; c < np; c += 16) {  // the softmax, 16 vectors at a time
      const __m512 old = _mm512_loadu_ps(w.mx.data() + c);
      __m512 top = old;
      for (int64_t t = 0; t < count; ++t) top = _mm512_max_ps(top, _mm512_loadu_ps(st + t * np + c));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < count; ++t) {
        const __m512 x = _mm512_loadu_ps(st + t * np + c);
        const __mmask16 seen = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_UQ);
        const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, top)));
        _mm512_storeu_ps(st + t * np + c, e);
        sum = _mm512_add_ps(sum, e);
      }
      // Earlier keys' sums rescaled where the maximum rose (none yet: their sums are 0).
      const __m512 f = exp16(_mm512_sub_ps(old, top));
      rose = rose || _mm512_cmp_ps_mask(top, old, _CMP_GT_OQ) != 0;
      _mm512_storeu_ps(w.fv.data() + c, f);
      _mm512_storeu_ps(w.sum.data() + c,
                       _mm512_fmadd_ps(_mm512_loadu_ps(w.sum.data() + c), f, sum));
      _mm512_storeu_ps(w.mx.data() + c, top);
    }
    if (rose && s0 > 0) {
      for (int64_t r = 0; r < n; ++r) {
        if (w.fv[r] == 1.f) continue;
        const __m512 f = _mm512_set1_ps(w.fv[r]);
        float* ar = w.acc.data() + r * hd;
        for (int64_t d = 0; d < hd; d += 16) {
          _mm512_storeu_ps(ar + d, _mm512_mul_ps(_mm512_loadu_ps(ar + d), f));
        }
      }
    }
    for (int64_t t0 = s0; t0 < s1; t0 += bs) {
      lane_weighted_rows(w.acc.data(), n, hd, st + (t0 - s0) * np, np, v_base + block(t0),
                         sh.key_stride, std::min(bs, s1 - t0));
    }
  }
  finish_unit(it, h0, nh, sh, o_base, w);
}

#endif

// A unit of a few rows (decodes, verifications): one pass over its keys in steps
// of at least kStepKeys (whole blocks), each step's K then its V (the softmax
// folded step by step), the next step's K and V asked for a few lines between
// each vector's scores and weighted sums. Measured (32 decodes of 760 keys, 2
// cores, K/V from memory): about 0.85x the time of three passes per chunk with
// each next block asked for in one burst in float32, 0.75x in bfloat16.
template <typename T>
void attend_few_rows(const int64_t* it, int64_t h0, int64_t nh, const Shapes& sh, float scale,
                     const T* q_base, T* o_base, const T* k_base, const T* v_base,
                     const int32_t* tables, Scratch& w) {
  const int64_t hd = sh.head_dim, bs = sh.block_size, keys = it[2];
  const int32_t* table = tables + it[3] * sh.bt_stride;
  const int64_t per_head = it[1] * sh.group;
  const int64_t step = std::max<int64_t>(1, kStepKeys / bs) * bs;
  const bool use_pairs = dot_pair_scores<T>(hd);
  const int64_t n = start_unit(it, h0, nh, sh, scale, q_base, use_pairs, step, w);
  const int64_t off = h0 * hd, row_bytes = nh * hd * static_cast<int64_t>(sizeof(T));
  const int64_t stride_bytes = sh.key_stride * static_cast<int64_t>(sizeof(T));
  const auto block = [&](int64_t t0) {  // the offset of the block holding key t0
    return static_cast<int64_t>(table[t0 / bs]) * sh.block_stride + off;
  };
  for (int64_t s0 = 0; s0 < keys; s0 += step) {
    const int64_t s1 = std::min(keys, s0 + step);
    w.ahead.clear();
    for (int64_t t0 = s1; t0 < std::min(keys, s1 + step); t0 += bs) {
      const int64_t rows = std::min(bs, keys - t0);
      w.ahead.add(k_base + block(t0), rows, row_bytes, stride_bytes);
      w.ahead.add(v_base + block(t0), rows, row_bytes, stride_bytes);
    }
    const int64_t per_call = (w.ahead.pending() + 2 * n - 1) / (2 * n);
    for (int64_t r = 0; r < n; ++r) {
      w.ahead.issue(per_call);
      for (int64_t t0 = s0; t0 < s1; t0 += bs) {
        const int64_t lim = std::min(bs, w.seen[r] - t0);
        if (lim <= 0) break;
        unit_scores(w, r, k_base + block(t0) + r / per_head * hd, lim, sh, use_pairs, scale,
                    w.s.data() + r * step + (t0 - s0));
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      const int64_t count = std::min(s1, w.seen[r]) - s0;
      if (count > 0) fold_scores(w, r, w.s.data() + r * step, count, hd);
    }
    for (int64_t r = 0; r < n; ++r) {
      w.ahead.issue(per_call);
      for (int64_t t0 = s0; t0 < s1; t0 += bs) {
        const int64_t lim = std::min(bs, w.seen[r] - t0);
        if (lim <= 0) break;
        accumulate(w.acc.data() + r * hd, w.s.data() + r * step + (t0 - s0),
                   v_base + block(t0) + r / per_head * hd, lim, sh.key_stride, hd);
      }
    }
  }
  finish_unit(it, h0, nh, sh, o_base, w);
}

}  // namespace

void paged_attention_rows(
    at::Tensor out,
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_tables,
    const at::Tensor& items,
    double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "query and out: [tokens, heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "caches: [blocks, block_size, kv_heads, head_dim]");
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && out.scalar_type() == dtype &&
                  key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "query, out and caches: all float32 or all bfloat16");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out: contiguous head_dim");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches: contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1,
              "block_tables: int32 [seqs, blocks], contiguous rows");
  TORCH_CHECK(items.scalar_type() == at::kLong && items.dim() == 2 && items.size(1) == 4 &&
                  items.is_contiguous(),
              "items: int64 [n, 4] (row, rows, keys, seq)");

  Shapes sh;
  sh.heads = query.size(1);
  sh.head_dim = query.size(2);
  sh.block_size = key_cache.size(1);
  sh.kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == sh.head_dim && sh.heads % sh.kv_heads == 0,
              "head shapes disagree");
  sh.group = sh.heads / sh.kv_heads;
  sh.qs0 = query.stride(0);
  sh.qs1 = query.stride(1);
  sh.os0 = out.stride(0);
  sh.os1 = out.stride(1);
  sh.key_stride = sh.kv_heads * sh.head_dim;  // between tokens of a block
  sh.block_stride = sh.block_size * sh.key_stride;
  sh.bt_stride = block_tables.stride(0);
  const int64_t num_items = items.size(0);
  const int64_t* its = items.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_items; ++i) {
    const int64_t* it = its + 4 * i;
    TORCH_CHECK(it[1] >= 1 && it[1] <= it[2] && it[0] >= 0 && it[0] + it[1] <= query.size(0),
                "item ", i, ": rows out of range");
    TORCH_CHECK(it[3] >= 0 && it[3] < block_tables.size(0), "item ", i, ": no such sequence");
    const int64_t used = (it[2] + sh.block_size - 1) / sh.block_size;
    TORCH_CHECK(used <= block_tables.size(1), "item ", i, ": more keys than its block table holds");
    const int32_t* row = block_tables.data_ptr<int32_t>() + it[3] * sh.bt_stride;
    for (int64_t b = 0; b < used; ++b) {
      TORCH_CHECK(row[b] >= 0 && row[b] < key_cache.size(0), "item ", i, ": block ", row[b],
                  " is not in the cache");
    }
  }
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const float sc = static_cast<float>(scale);
  // Units: an item of a few rows (decodes, verifications) takes all its KV heads
  // in one, reading its K/V rows whole, where the items give each thread one
  // (measured: faster than finer units balanced better), else it is split by KV
  // heads; an item of more rows (a prompt) takes one KV head per unit, and tiles
  // of kTileRows of its rows, each seeing the keys up to its last row: its K/V
  // blocks are read once per tile, and its scores stay in cache.
  int64_t parts = 1;
  while (num_items * parts < at::get_num_threads() && parts < sh.kv_heads) {
    do ++parts; while (sh.kv_heads % parts != 0);
  }
  struct Unit {
    int64_t item[4];  // row, rows, keys, seq: the item's or one tile of its rows
    bool tile;
    int64_t h0, nh;
  };
  std::vector<Unit> units;
  for (int64_t i = 0; i < num_items; ++i) {
    const int64_t* it = its + 4 * i;
    if (it[1] <= kWholeRowsMaxRows) {
      const int64_t nh = sh.kv_heads / parts;
      for (int64_t h0 = 0; h0 < sh.kv_heads; h0 += nh) {
        units.push_back({{it[0], it[1], it[2], it[3]}, false, h0, nh});
      }
      continue;
    }
    // Largest tiles first: the causal triangle makes the last rows the costliest.
    for (int64_t a = (it[1] - 1) / kTileRows * kTileRows; a >= 0; a -= kTileRows) {
      const int64_t b = std::min(it[1], a + kTileRows);
      for (int64_t h0 = 0; h0 < sh.kv_heads; ++h0) {
        units.push_back({{it[0] + a, b - a, it[2] - it[1] + b, it[3]}, true, h0, 1});
      }
    }
  }
  const int64_t num_units = static_cast<int64_t>(units.size());
  // Each thread one run of consecutive units of about equal work (query rows x
  // the keys each sees, plus a unit's fixed cost): a prompt's tiles differ in
  // work by its length, and an even split by count left one thread the largest.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_units));
  std::vector<int64_t> bounds(threads + 1, num_units);
  {
    std::vector<double> work(num_units + 1, 0.0);
    for (int64_t u = 0; u < num_units; ++u) {
      const int64_t rows = units[u].item[1], keys = units[u].item[2];
      const double seen = rows * (keys - (rows - 1) / 2.0);
      work[u + 1] = work[u] + units[u].nh * (seen + kUnitCostPairs);
    }
    bounds[0] = 0;
    for (int64_t t = 1, u = 0; t < threads; ++t) {  // the boundary nearest each share
      const double target = work[num_units] * t / threads;
      while (u < num_units && work[u] < target) ++u;
      if (u > bounds[t - 1] && target - work[u - 1] < work[u] - target) --u;
      bounds[t] = u;
    }
  }
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* q_base = static_cast<const T*>(query.data_ptr());
    T* o_base = static_cast<T*>(out.data_ptr());
    const T* k_base = static_cast<const T*>(key_cache.data_ptr());
    const T* v_base = static_cast<const T*>(value_cache.data_ptr());
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      Scratch w;
      const int64_t begin = bounds[first], end = bounds[last];
      for (int64_t u = begin; u < end; ++u) {
        if (u + 1 < end) {  // the next unit's first K and V blocks, while this one runs
          const Unit& next = units[u + 1];
          const int64_t* it = next.item;
          const int32_t* row = tables + it[3] * sh.bt_stride;
          // A tile's first chunk; a unit of a few rows asks for the rest itself.
          const int64_t used =
              next.tile ? std::min<int64_t>((it[2] + sh.block_size - 1) / sh.block_size,
                                            kChunkKeys / sh.block_size)
                        : 1;
          for (int64_t b = 0; b < used; ++b) {
            const int64_t off = row[b] * sh.block_stride + next.h0 * sh.head_dim;
            const int64_t rows = std::min(sh.block_size, it[2] - b * sh.block_size);
            prefetch_rows(k_base + off, rows, sh.key_stride, next.nh * sh.head_dim);
            prefetch_rows(v_base + off, rows, sh.key_stride, next.nh * sh.head_dim);
          }
        }
        const Unit& un = units[u];
        if (un.tile) {
#if defined(__AVX512F__)
          if constexpr (std::is_same_v<T, float>) {
            if (lanes_tile<T>(sh.head_dim, un.item[2])) {
              attend_tile_lanes(un.item, un.h0, un.nh, sh, sc, q_base, o_base, k_base, v_base,
                                tables, w);
              continue;
            }
          }
#endif
          attend_tile(un.item, un.h0, un.nh, sh, sc, q_base, o_base, k_base, v_base, tables, w);
        } else {
          attend_few_rows(un.item, un.h0, un.nh, sh, sc, q_base, o_base, k_base, v_base, tables,
                          w);
        }
      }
    });
  };
  if (dtype == at::kBFloat16) {
    run(c10::BFloat16());
  } else {
    run(0.f);
  }
}

TORCH_LIBRARY(testbed_cpu, m) {
  m.def(
      "paged_attention_rows(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor items, float scale) -> ()",
      &paged_attention_rows);
}
