// A linear layer's product for a few rows (decode steps, short chunks) on AVX-512
// CPUs: out = x W^T (+ bias), with W packed once by pack_linear_rows.
//
// For a few rows the product reads each weight once and does little arithmetic
// per byte, so its cost is the weight's stream from memory plus the call's fixed
// cost. oneDNN's packed GEMM pays tens of microseconds per call and streams at
// about half the memory's speed for 1-8 rows; this kernel walks W in groups of 64
// output columns, each group's weights contiguous, and keeps 4 rows x 64 columns of
// float32 sums in 16 registers:
//
// - bfloat16: W as [groups, ceil(K/2), 64, 2], each k pair of 64 columns one
//   512-bit load, multiplied with a row's (x[k], x[k+1]) by AVX-512 BF16 dot
//   pairs (exact products, float32 sums);
// - float32: W as [groups, K, 64], a fused multiply-add per k.
//
// Rows past 4 are taken 4 at a time within each group, whose 64-column slice of W
// is still in cache. Sums are float32 and rounded once (bfloat16: nearest-even),
// as oneDNN's; only their order differs. Groups are split over torch's intra-op
// threads. Where the CPU lacks the instructions, linear_rows_dtypes() leaves the
// dtype out and the caller keeps oneDNN.

#include "cpu_ops.h"
#include "cpu_vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <optional>
#include <vector>

// float32 needs AVX-512 F, BW and VL (masked 16-bit stores); bfloat16 also BF16.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TESTBED_ROWS_F32 1
#if defined(__AVX512BF16__)
#define TESTBED_ROWS_BF16 1
#endif
#endif

namespace {

using BF16 = c10::BFloat16;
constexpr int64_t kCols = 64;  // output columns per group: 4 registers of 16 float32
constexpr int64_t kRows = 4;   // rows per pass over a group: 4 x 4 sums in registers

#ifdef TESTBED_ROWS_F32

// Sums of rows [0, M) of x against one group's packed weights, into acc [M, 64].
template <int M>
void group_f32(const float* x, int64_t K, const float* w, float* acc) {
  __m512 s[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) s[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kCols;
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(wk + 16 * j);
    if constexpr (M > 1) testbed_cpu_vec::pin(wv);  // each is used M times
    for (int m = 0; m < M; ++m) {
      const __m512 b = _mm512_set1_ps(x[m * K + k]);
      for (int j = 0; j < 4; ++j) s[m][j] = _mm512_fmadd_ps(wv[j], b, s[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + m * kCols + j * 16, s[m][j]);
}

#ifdef TESTBED_ROWS_BF16
template <int M>
void group_bf16(const BF16* x, int64_t K, const BF16* w, float* acc) {
  __m512 s[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) s[m][j] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i* wp = reinterpret_cast<const __m512i*>(w + p * kCols * 2);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 1);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 2), w3 = (__m512bh)_mm512_loadu_si512(wp + 3);
    for (int m = 0; m < M; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * p, sizeof pair);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      s[m][0] = _mm512_dpbf16_ps(s[m][0], w0, b);
      s[m][1] = _mm512_dpbf16_ps(s[m][1], w1, b);
      s[m][2] = _mm512_dpbf16_ps(s[m][2], w2, b);
      s[m][3] = _mm512_dpbf16_ps(s[m][3], w3, b);
    }
  }
  if (K % 2) {  // the last k of an odd K: its pair's second weight is the packing's zero
    const __m512i* wp = reinterpret_cast<const __m512i*>(w + pairs * kCols * 2);
    for (int m = 0; m < M; ++m) {
      uint16_t last;
      std::memcpy(&last, x + m * K + K - 1, sizeof last);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(last);
      for (int j = 0; j < 4; ++j)
        s[m][j] = _mm512_dpbf16_ps(s[m][j], (__m512bh)_mm512_loadu_si512(wp + j), b);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + m * kCols + j * 16, s[m][j]);
}
#endif

// acc [M, 64] (+ bias) into out's rows [0, M), columns [n0, n0 + n).
template <typename T>
void store_rows(T* out, int64_t ldo, const float* acc, int M, int64_t n0, int64_t n,
                const T* bias) {
  for (int m = 0; m < M; ++m) {
    T* o = out + m * ldo + n0;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = j + 16 <= n ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
      __m512 v = _mm512_loadu_ps(acc + m * kCols + j);
      if constexpr (std::is_same_v<T, float>) {
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias + n0 + j));
        _mm512_mask_storeu_ps(o + j, live, v);
      } else {
        if (bias) {
          const __m256i b = _mm256_maskz_loadu_epi16(live, bias + n0 + j);
          v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
        }
#ifdef TESTBED_ROWS_BF16  // the only build that instantiates this branch
        // The CPU's own rounding to bfloat16: nearest-even, as torch's.
        _mm256_mask_storeu_epi16(o + j, live, (__m256i)_mm512_cvtneps_pbh(v));
#endif
      }
    }
  }
}

template <typename T, int M>
void group_rows(const T* x, int64_t K, const T* w, float* acc) {
  if constexpr (std::is_same_v<T, float>) {
    group_f32<M>(x, K, w, acc);
  } else {
#ifdef TESTBED_ROWS_BF16
    group_bf16<M>(x, K, w, acc);
#endif
  }
}

template <typename T>
void linear_rows_t(T* out, const T* x, const T* w, const T* bias, int64_t rows, int64_t n,
                   int64_t k) {
  const int64_t groups = (n + kCols - 1) / kCols;
  const int64_t group_size = std::is_same_v<T, float> ? k * kCols : (k + 1) / 2 * kCols * 2;
  at::parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    alignas(64) float acc[kRows * kCols];
    for (int64_t g = g0; g < g1; ++g) {
      const T* wg = w + g * group_size;
      const int64_t n0 = g * kCols, cols = std::min(kCols, n - n0);
      for (int64_t r = 0; r < rows; r += kRows) {
        const int m = static_cast<int>(std::min(kRows, rows - r));
        switch (m) {
          case 1: group_rows<T, 1>(x + r * k, k, wg, acc); break;
          case 2: group_rows<T, 2>(x + r * k, k, wg, acc); break;
          case 3: group_rows<T, 3>(x + r * k, k, wg, acc); break;
          default: group_rows<T, 4>(x + r * k, k, wg, acc); break;
        }
        store_rows<T>(out + r * n, n, acc, m, n0, cols, bias);
      }
    }
  });
}

#endif  // TESTBED_ROWS_F32

bool supported(at::ScalarType dtype) {
#ifdef TESTBED_ROWS_BF16
  if (dtype == at::kBFloat16) return true;
#endif
#ifdef TESTBED_ROWS_F32
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

std::vector<std::string> linear_rows_dtypes() {
  std::vector<std::string> out;
  if (supported(at::kFloat)) out.emplace_back("float32");
  if (supported(at::kBFloat16)) out.emplace_back("bfloat16");
  return out;
}

// weight [N, K] -> this kernel's layout (see the top of the file), zero padded.
at::Tensor pack_linear_rows(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_rows: weight [out_features, in_features]");
  TORCH_CHECK(supported(weight.scalar_type()), "pack_linear_rows: ", weight.scalar_type(),
              " is not built for this CPU");
  const int64_t n = weight.size(0), k = weight.size(1), groups = (n + kCols - 1) / kCols;
  const int64_t pad_n = groups * kCols - n;
  if (weight.scalar_type() == at::kFloat) {
    return at::constant_pad_nd(weight, {0, 0, 0, pad_n})
        .view({groups, kCols, k})
        .permute({0, 2, 1})
        .contiguous();
  }
  const int64_t pairs = (k + 1) / 2;
  return at::constant_pad_nd(weight, {0, pairs * 2 - k, 0, pad_n})
      .view({groups, kCols, pairs, 2})
      .permute({0, 2, 1, 3})
      .contiguous();
}

}  // namespace

void linear_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                 const std::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(supported(dtype), "linear_rows: ", dtype, " is not built for this CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "linear_rows: x [rows, in_features], contiguous");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.scalar_type() == dtype,
              "linear_rows: out [rows, out_features] of x's dtype, contiguous");
  TORCH_CHECK(packed.scalar_type() == dtype && packed.is_contiguous(),
              "linear_rows: packed weight of x's dtype (pack_linear_rows)");
  const int64_t rows = x.size(0), n = out.size(1), k = x.size(1);
  const int64_t groups = (n + kCols - 1) / kCols;
  const bool fits = dtype == at::kFloat
                        ? packed.dim() == 3 && packed.size(0) == groups && packed.size(1) == k
                        : packed.dim() == 4 && packed.size(0) == groups &&
                              packed.size(1) == (k + 1) / 2;
  TORCH_CHECK(fits, "linear_rows: packed weight ", packed.sizes(), " is not [", n, ", ", k,
              "] packed");
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == dtype && b.numel() == n),
              "linear_rows: bias [out_features] of x's dtype");
#ifdef TESTBED_ROWS_F32
  if (dtype == at::kFloat) {
    linear_rows_t<float>(out.data_ptr<float>(), x.data_ptr<float>(), packed.data_ptr<float>(),
                         b.defined() ? b.data_ptr<float>() : nullptr, rows, n, k);
    return;
  }
#endif
#ifdef TESTBED_ROWS_BF16
  {
    linear_rows_t<BF16>(static_cast<BF16*>(out.data_ptr()), static_cast<const BF16*>(x.data_ptr()),
                        static_cast<const BF16*>(packed.data_ptr()),
                        b.defined() ? static_cast<const BF16*>(b.data_ptr()) : nullptr, rows, n, k);
  }
#endif
}

TORCH_LIBRARY_FRAGMENT(testbed_cpu, m) {
  m.def("linear_rows_dtypes() -> str[]", &linear_rows_dtypes);
  m.def("pack_linear_rows(Tensor weight) -> Tensor", &pack_linear_rows);
  m.def("linear_rows(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()", &linear_rows);
}
