// What the native kernels share (included once per library, by paged_attention.cpp and
// decode_simd.h): torch's OpenMP team, a softmax's exp, and exact widening to float /
// rounding back of float32 and bfloat16 values.
#pragma once
#include <cstdint>
#include <cstring>
#include <dlfcn.h>

namespace {

// torch's OpenMP team, when this process has one (libgomp's entry point, or a runtime
// that provides it): its workers are the ones spinning after every torch op, so work
// handed to them starts at once, where a thread of ours would share a core with one.
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
GompParallel gomp_parallel() {
  static const GompParallel f = reinterpret_cast<GompParallel>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
  return f;
}
template <class F>
void call(void* f) {
  (*static_cast<F*>(f))();
}

// e^x for x <= 0 (a score minus the row's max), no float-to-int conversion so that it
// vectorises: n = round(x log2 e) by the 1.5 * 2^23 trick, e^r on |r| <= ln2/2 by
// Cephes' polynomial, times 2^n built from n's bits. Below -87: e^-87 (~1.6e-38).
inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;  // a NaN stays NaN
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float t = x * 1.44269504088896341f + magic;
  float n = t - magic;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  uint32_t tb, mb;
  std::memcpy(&tb, &t, 4);
  std::memcpy(&mb, &magic, 4);
  uint32_t bits = (tb - mb + 127u) << 23;  // 2^n
  float p;
  std::memcpy(&p, &bits, 4);
  return y * p;
}

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, uint16_t* out) {  // round to nearest even (torch's rule)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *out = 0x7fc0;  // NaN
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *out = uint16_t(u >> 16);
}

}  // namespace
