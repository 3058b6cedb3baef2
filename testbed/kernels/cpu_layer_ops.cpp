// A decoder layer's elementwise steps on a CPU, each one pass over its rows
// instead of the several torch ops (and float32 temporaries) the reference
// modules in testbed/engine/model.py take:
//
// - rms_norm(out, x, weight, eps): the model's RMSNorm;
// - add_rms_norm(residual, x, weight, out, eps): residual += x, then out = the
//   RMSNorm of the sum (a layer's residual add and the next norm, one pass);
// - silu_and_mul(out, gate_up): silu(gate) * up, gate and up the two halves of
//   each row;
// - rotary(out, x, cos, sin): the "rotate half" rotary embedding;
// - reshape_and_cache(key, value, key_cache, value_cache, slot_mapping): each
//   token's K/V rows into its cache slot (slot -1: skipped), a copy per row.
//
// float32 or bfloat16. Each computes in float32 and rounds (nearest-even) exactly
// where the torch modules round a bfloat16 tensor: RMSNorm's normalized rows
// before the weight and after it, silu's output before the product, the rotated
// values once. Only sums may differ from torch's in their order. Rows are split
// over torch's intra-op threads (at::parallel_for).

#include "cpu_ops.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using testbed_cpu_vec::BF16;
#if defined(__AVX2__) && defined(__FMA__)
using testbed_cpu_vec::held8;
using testbed_cpu_vec::hsum;
using testbed_cpu_vec::load8;
using testbed_cpu_vec::store8;
#endif

using testbed_cpu_vec::widen;

// A value as the tensor of type T holds it: rounded to T and back to float32.
template <typename T>
inline float held(float x) {
  return widen(static_cast<T>(x));
}

// out = w * held(r * inv) for one row r already as T holds it (float32 lanes from
// `src`), inv = 1 / sqrt(mean(r^2) + eps); `sq` is the row's sum of squares.
template <typename T>
inline void scale_row(T* out, const T* src, const T* w, int64_t n, float sq, float eps) {
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 iv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) {
    store8(out + i, _mm256_mul_ps(load8(w + i), held8(T(), _mm256_mul_ps(load8(src + i), iv))));
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<T>(widen(w[i]) * held<T>(widen(src[i]) * inv));
}

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float sq = 0.f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  sq = hsum(acc);
#endif
  for (; i < n; ++i) sq += widen(x[i]) * widen(x[i]);
  return sq;
}

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* w, int64_t rows, int64_t n, int64_t xs,
                   int64_t os, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      scale_row(out + r * os, x + r * xs, w, n, sum_squares(x + r * xs, n), eps);
    }
  });
}

// residual += x (rounded as T, the residual stream's add), then out = its RMSNorm.
template <typename T>
void add_rms_norm_rows(T* res, const T* x, const T* w, T* out, int64_t rows, int64_t n,
                       int64_t rs, int64_t xs, int64_t os, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* rr = res + r * rs;
      const T* xr = x + r * xs;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= n; i += 8) store8(rr + i, _mm256_add_ps(load8(rr + i), load8(xr + i)));
#endif
      for (; i < n; ++i) rr[i] = static_cast<T>(widen(rr[i]) + widen(xr[i]));
      scale_row(out + r * os, rr, w, n, sum_squares(rr, n), eps);
    }
  });
}

// silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) (never overflows):
// 1 / (1 + e) for g >= 0, e / (1 + e) below.
inline float silu(float g) {
  const float e = testbed_cpu_vec::exp_nonpositive(-std::fabs(g));
  return g * (g >= 0.f ? 1.f : e) / (1.f + e);
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 silu8(__m256 g) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 e = testbed_cpu_vec::exp8(_mm256_or_ps(g, sign));  // exp(-|g|)
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 top = _mm256_blendv_ps(one, e, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
  return _mm256_div_ps(_mm256_mul_ps(g, top), _mm256_add_ps(one, e));
}

#endif

template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t n, int64_t xs, int64_t os) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = x + r * xs;
      const T* up = gate + n;
      T* orow = out + r * os;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= n; i += 8) {
        const __m256 act = held8(T(), silu8(load8(gate + i)));
        store8(orow + i, _mm256_mul_ps(act, load8(up + i)));
      }
#endif
      for (; i < n; ++i) {
        orow[i] = static_cast<T>(held<T>(silu(widen(gate[i]))) * widen(up[i]));
      }
    }
  });
}

// x: [tokens, heads, d] with strides (s0, s1, 1); out contiguous [tokens, heads, d];
// cos, sin: float32 [tokens, d] contiguous.
template <typename T>
void rotary_rows(T* out, const T* x, const float* cos, const float* sin, int64_t tokens,
                 int64_t heads, int64_t d, int64_t s0, int64_t s1) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos + t * d;
      const float* s = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * s0 + h * s1;
        T* orow = out + (t * heads + h) * d;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= half; i += 8) {
          const __m256 a = load8(xr + i), b = load8(xr + i + half);
          store8(orow + i, _mm256_fmsub_ps(a, load8(c + i), _mm256_mul_ps(b, load8(s + i))));
          store8(orow + i + half,
                 _mm256_fmadd_ps(b, load8(c + i + half), _mm256_mul_ps(a, load8(s + i + half))));
        }
#endif
        for (; i < half; ++i) {
          const float a = widen(xr[i]), b = widen(xr[i + half]);
          orow[i] = static_cast<T>(a * c[i] - b * s[i]);
          orow[i + half] = static_cast<T>(b * c[i + half] + a * s[i + half]);
        }
      }
    }
  });
}

void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected ", dtype, ", got ", t.scalar_type());
}

template <typename Fn>
void by_dtype(at::ScalarType dtype, Fn fn) {
  if (dtype == at::kBFloat16) {
    fn(BF16());
  } else {
    TORCH_CHECK(dtype == at::kFloat, "float32 or bfloat16 only, got ", dtype);
    fn(0.f);
  }
}

}  // namespace

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && x.stride(1) == 1 &&
                  out.stride(1) == 1 && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: x and out [rows, n] with contiguous rows, weight [n]");
  check_dtype(out, x.scalar_type(), "out");
  check_dtype(weight, x.scalar_type(), "weight");
  by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows(static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()),
                  static_cast<const T*>(weight.data_ptr()), x.size(0), x.size(1), x.stride(0),
                  out.stride(0), static_cast<float>(eps));
  });
}

void add_rms_norm(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight,
                  at::Tensor out, double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && out.sizes() == x.sizes() &&
                  x.stride(1) == 1 && residual.stride(1) == 1 && out.stride(1) == 1 &&
                  weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm: residual, x and out [rows, n] with contiguous rows, weight [n]");
  check_dtype(residual, x.scalar_type(), "residual");
  check_dtype(out, x.scalar_type(), "out");
  check_dtype(weight, x.scalar_type(), "weight");
  by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_rows(static_cast<T*>(residual.data_ptr()), static_cast<const T*>(x.data_ptr()),
                      static_cast<const T*>(weight.data_ptr()), static_cast<T*>(out.data_ptr()),
                      x.size(0), x.size(1), residual.stride(0), x.stride(0), out.stride(0),
                      static_cast<float>(eps));
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0) &&
                  2 * out.size(1) == x.size(1) && x.stride(1) == 1 && out.stride(1) == 1,
              "silu_and_mul: x [rows, 2n], out [rows, n], contiguous rows");
  check_dtype(out, x.scalar_type(), "out");
  by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_rows(static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()),
                      x.size(0), out.size(1), x.stride(0), out.stride(0));
  });
}

void rotary(at::Tensor out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && out.sizes() == x.sizes() && out.is_contiguous() &&
                  x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: x [tokens, heads, d] (d even, contiguous), out contiguous like it");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel(),
              "rotary: cos and sin float32 [tokens, d], contiguous");
  check_dtype(out, x.scalar_type(), "out");
  by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rotary_rows(static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()),
                cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), x.size(1), x.size(2),
                x.stride(0), x.stride(1));
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                       at::Tensor value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 &&
                  value.stride(2) == 1,
              "reshape_and_cache: key and value [tokens, kv_heads, head_dim], contiguous rows");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                  key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "reshape_and_cache: caches [blocks, block_size, kv_heads, head_dim], contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0),
              "reshape_and_cache: slot_mapping int64 [tokens]");
  const auto dtype = key_cache.scalar_type();
  check_dtype(key, dtype, "key");
  check_dtype(value, dtype, "value");
  check_dtype(value_cache, dtype, "value_cache");
  const int64_t tokens = key.size(0), heads = key.size(1), d = key.size(2);
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] < slots, "reshape_and_cache: token ", t, ": slot ", slot[t],
                " past the cache's ", slots);
  }
  const int64_t bytes = d * static_cast<int64_t>(key.element_size());
  const auto copy = [&](const at::Tensor& src, at::Tensor& cache) {
    const char* base = static_cast<const char*>(src.data_ptr());
    char* dst = static_cast<char*>(cache.data_ptr());
    const int64_t s0 = src.stride(0) * src.element_size(), s1 = src.stride(1) * src.element_size();
    at::parallel_for(0, tokens, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        if (slot[t] < 0) continue;
        char* row = dst + slot[t] * heads * bytes;
        for (int64_t h = 0; h < heads; ++h) std::memcpy(row + h * bytes, base + t * s0 + h * s1, bytes);
      }
    });
  };
  copy(key, key_cache);
  copy(value, value_cache);
}

TORCH_LIBRARY_FRAGMENT(testbed_cpu, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()",
      &reshape_and_cache);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()", &rms_norm);
  m.def(
      "add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, Tensor(b!) out, float eps) -> ()",
      &add_rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()", &silu_and_mul);
  m.def("rotary(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin) -> ()", &rotary);
}
