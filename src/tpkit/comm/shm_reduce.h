// The arithmetic of tpkit's shared-memory collectives (included by shm.cpp): float32,
// bfloat16 and float16 loaded as float, combined in rank order, stored rounded once to
// nearest even, so every rank computes the same bits for any element.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace {

constexpr size_t kBlock = 512;  // elements accumulated at a time in float

// -- element types: load as float, store rounded to nearest even ----------------------
inline float load(float x) { return x; }
inline float load(uint16_t b) {  // bfloat16
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline float load(_Float16 x) { return static_cast<float>(x); }
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) { *p = static_cast<uint16_t>((u >> 16) | 0x40); return; }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}
inline void store(_Float16* p, float x) { *p = static_cast<_Float16>(x); }

inline float combine(float a, float b, int op) {
  if (op == 0) return a + b;
  if (op == 1) return a < b ? b : a;
  return b < a ? b : a;
}

// out[i] = src[0][i] (op) src[1][i] (op) ... in rank order, float accumulation.
template <class T>
void reduce_into(T* out, T* const* src, int n, size_t count, int op) {
  float acc[kBlock];
  for (size_t lo = 0; lo < count; lo += kBlock) {
    size_t m = count - lo < kBlock ? count - lo : kBlock;
    for (size_t i = 0; i < m; ++i) acc[i] = load(src[0][lo + i]);
    for (int j = 1; j < n; ++j) {
      const T* s = src[j] + lo;
      if (op == 0) {
        for (size_t i = 0; i < m; ++i) acc[i] += load(s[i]);
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] = combine(acc[i], load(s[i]), op);
      }
    }
    for (size_t i = 0; i < m; ++i) store(out + lo + i, acc[i]);
  }
}

}  // namespace
