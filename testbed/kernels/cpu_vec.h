// What the CPU kernels (cpu_paged_attention.cpp, cpu_layer_ops.cpp,
// cpu_linear_rows.cpp) share: exp(x) for x <= 0, scalar, 8 and 16 lanes; 8 lanes
// of float32 or bfloat16 loaded, stored and rounded (AVX2 + FMA); vectors pinned
// in registers (AVX-512).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace testbed_cpu_vec {

using BF16 = c10::BFloat16;

// A float32 or bfloat16 value as float32.
inline float widen(float x) { return x; }
inline float widen(BF16 x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (scores less their maximum): 2^n times a degree-6 polynomial
// of the remainder (Cephes' expf, relative error about 1e-7); below -87 it gives
// about 1e-38 rather than 0. Its constants, shared by the scalar and vector forms:
constexpr float kExpFloor = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  x = std::max(x, kExpFloor);
  const float n = std::floor(x * kLog2e + 0.5f);
  const float r = x - n * kLn2Hi - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 x) {  // exp_nonpositive, 8 lanes
  const auto c = [](float v) { return _mm256_set1_ps(v); };
  x = _mm256_max_ps(x, c(kExpFloor));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, c(kLog2e), c(0.5f)));
  const __m256 r = _mm256_fnmadd_ps(n, c(kLn2Lo), _mm256_fnmadd_ps(n, c(kLn2Hi), x));
  __m256 p = c(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, c(kExpPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), c(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
// Keeps loaded vectors in registers. Otherwise GCC folds the load into each
// multiply-add that uses the vector, one 64-byte load per multiply-add; on Zen 4
// (one such load a cycle) that held a float32 prompt tile to about 0.7x the rate
// it reaches with them pinned.
template <int N>
inline void pin(__m512 (&v)[N]) {
  static_assert(N >= 1 && N <= 4);
  if constexpr (N == 1) asm("" : "+v"(v[0]));
  if constexpr (N == 2) asm("" : "+v"(v[0]), "+v"(v[1]));
  if constexpr (N == 3) asm("" : "+v"(v[0]), "+v"(v[1]), "+v"(v[2]));
  if constexpr (N == 4) asm("" : "+v"(v[0]), "+v"(v[1]), "+v"(v[2]), "+v"(v[3]));
}

inline __m512 exp16(__m512 x) {  // exp_nonpositive, 16 lanes
  const auto c = [](float v) { return _mm512_set1_ps(v); };
  x = _mm512_max_ps(x, c(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, c(kLog2e), c(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, c(kLn2Lo), _mm512_fnmadd_ps(n, c(kLn2Hi), x));
  __m512 p = c(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, c(kExpPoly[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), c(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

// 8 values as float32 lanes: bfloat16 is the upper half of a float32's bits.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BF16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The bits of 8 float32 lanes rounded to bfloat16's (nearest-even; no NaN here),
// the low 16 bits cleared.
inline __m256i round_bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
  return _mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
}

// 8 float32 lanes stored as T (bfloat16: rounded to nearest-even).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(BF16* p, __m256 v) {
  const __m256i high = _mm256_srli_epi32(round_bf16_bits(v), 16);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// 8 float32 lanes as a tensor of T holds them: bfloat16's rounding, widened back.
inline __m256 held8(float, __m256 v) { return v; }
inline __m256 held8(BF16, __m256 v) { return _mm256_castsi256_ps(round_bf16_bits(v)); }

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif


}  // namespace testbed_cpu_vec
