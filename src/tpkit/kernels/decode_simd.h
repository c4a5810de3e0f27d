// Vector helpers of the decode kernels (included once, by decode_ops.cpp): the lane
// count L, int8's widening, vector loads and the fixed tree over the lanes (torch's
// OpenMP team and the float32 / bfloat16 conversions: native_common.h).
#pragma once
#include "native_common.h"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <dlfcn.h>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {


#if defined(__AVX512F__)
constexpr int L = 16;
#else
constexpr int L = 8;
#endif
typedef float vf __attribute__((vector_size(L * 4)));
typedef uint32_t vu __attribute__((vector_size(L * 4)));
typedef int32_t vi __attribute__((vector_size(L * 4)));
typedef uint16_t vh __attribute__((vector_size(L * 2)));
typedef int8_t vb __attribute__((vector_size(L)));


inline float widen(int8_t x) { return float(x); }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load(const uint16_t* p) {
#if defined(__AVX512F__)
  return vf(_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)));
#elif defined(__AVX2__)
  return vf(_mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16)));
#endif
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline vf load(const int8_t* p) {
#if defined(__AVX512F__)
  return vf(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return vf(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#endif
  vb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}

#if defined(__AVX2__)
inline float tree8(__m256 a) {  // lane l += lane l + 4, then l + 2, then l + 1
  const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
  return _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)));
}
#endif

inline float tree(vf a) {  // the lanes summed pairwise, a fixed tree
#if defined(__AVX512F__)
  const __m512 z = __m512(a);
  return tree8(_mm256_add_ps(_mm512_castps512_ps256(z),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1))));
#elif defined(__AVX2__)
  return tree8(__m256(a));
#endif
  float lane[L];
  std::memcpy(lane, &a, sizeof lane);
  for (int w = L / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

// sum of a[i] (b given: of a[i] * b[i]) for i < n: L lanes in order, the fixed tree, the
// n % L last terms in order.
inline float lanes_sum(const float* a, int64_t n, const float* b) {
  vf acc = vf{};
  int64_t i = 0;
  for (; i + L <= n; i += L) acc += b != nullptr ? load(a + i) * load(b + i) : load(a + i);
  float t = tree(acc);
  for (; i < n; ++i) t += b != nullptr ? a[i] * b[i] : a[i];
  return t;
}

}  // namespace
