// What the native kernels share (included once per library, by paged_attention.cpp and
// decode_simd.h): torch's OpenMP team, and exact widening to float / rounding back of
// float32 and bfloat16 values.
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
