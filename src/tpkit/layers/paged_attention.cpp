// Decode attention over a paged KV cache (called through ctypes: layers/paged_attention.py).
//
// For every decode row r (one query token) and every local query head h:
//   out[row_r, h, :] = softmax(q[row_r, h, :] . K^T * scale) V
// over that row's keys lo_r <= j < end_r, key j read in place from the flat cache
//   k, v [positions, nkv, hd], position = table_r[j / bs] * bs + j % bs
// with the kv head kv_map[h] (GQA: a plain group or an uneven mapping); scale = 1/sqrt(hd).
//
// Batch invariance by construction: a work item is one (row, kv head), computed whole
// by one thread in an order fixed by the row's own length: each score is a dot product
// summed over d in order (lanes over 16 keys, the sum of each lane sequential over d),
// the softmax's denominator summed in 16 lanes (j % 16) then a fixed tree, each output
// element summed over j in order. Nothing depends on the other rows, on the number of
// threads, or on where the blocks lie.
//
// Softmax in two passes: every score stored, their max, then exp(score - max) (a
// vectorisable Cephes-style exp, ~1 ulp). float32 or bfloat16 caches and queries
// (bfloat16: widened exactly to float, float accumulation, the output rounded to
// nearest even once). Threads (std::thread, not OpenMP) over the work items only when
// the call's work is above THREAD_WORK multiply-adds.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int TILE = 16;  // keys per score tile (the lanes of the score loop)
constexpr int LANES = 16;  // lanes of the softmax denominator's sum
constexpr int64_t THREAD_WORK = 1 << 22;  // q.k and p.v multiply-adds before threads pay

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

struct Call {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int64_t* meta;  // [nrows, 4]: row, table offset, lo, end; then the tables
  const int32_t* kv_map;  // [nq]
  int nrows, nq, nkv, hd, bs;
  float scale;
  std::vector<int> order;  // the query heads sorted by kv head (stable)
  std::vector<int> first;  // [nkv + 1]: kv head kv's heads are order[first[kv]:first[kv+1]]
  int64_t max_len;
};

// q . k over hd in 16 lanes (lane l sums d = l, l + 16, ... in order), then a fixed tree.
template <int HD>
inline float dot(const float* __restrict a, const float* __restrict b, int hd) {
  if (HD > 0) hd = HD;
  float lane[LANES] = {};
  int d = 0;
  for (; d + LANES <= hd; d += LANES)
    for (int l = 0; l < LANES; ++l) lane[l] += a[d + l] * b[d + l];
  for (int l = 0; d + l < hd; ++l) lane[l] += a[d + l] * b[d + l];
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

// acc[d] += sum over the tile's keys t, in order, of p[t] * v[t][d].
template <int HD>
inline void axpy_tile(float* __restrict acc, const float* __restrict p, const float* v,
                      int64_t stride, int n, int hd) {
  if (HD > 0) {
    float a[HD > 0 ? HD : 1];
    for (int d = 0; d < HD; ++d) a[d] = acc[d];
    for (int t = 0; t < n; ++t)
      for (int d = 0; d < HD; ++d) a[d] += p[t] * v[t * stride + d];
    for (int d = 0; d < HD; ++d) acc[d] = a[d];
  } else {
    for (int t = 0; t < n; ++t)
      for (int d = 0; d < hd; ++d) acc[d] += p[t] * v[t * stride + d];
  }
}

// A tile of n rows (keys or values) as float: the cache itself (stride: positions), or
// bfloat16 widened into buf (stride hd).
inline const float* rows(const float* src, int, int64_t, int, float*, int64_t* stride_out,
                         int64_t stride) {
  *stride_out = stride;
  return src;
}
inline const float* rows(const uint16_t* src, int n, int64_t stride, int hd, float* buf,
                         int64_t* stride_out, int64_t) {
  for (int t = 0; t < n; ++t)
    for (int d = 0; d < hd; ++d) buf[t * hd + d] = widen(src[t * stride + d]);
  *stride_out = hd;
  return buf;
}

// Ask for the next block's part of the item (its n positions' kv heads k0..k1) while
// this one is computed: the blocks lie anywhere, so the hardware cannot guess the jump.
template <typename T>
inline void prefetch(const T* base, int n, int64_t stride, int64_t len) {
  for (int t = 0; t < n; ++t)
    for (int64_t e = 0; e < len; e += 64 / int64_t(sizeof(T)))
      __builtin_prefetch(base + t * stride + e);
}

// One work item: row r's query heads that read kv heads k0 <= kvh < k1.
template <typename T, int HD>
void item(const Call& c, int64_t r, int k0, int k1, float* __restrict scratch) {
  const int64_t* m = c.meta + 4 * r;
  const int hd = HD > 0 ? HD : c.hd, bs = c.bs;
  const int64_t row = m[0], lo = m[2], end = m[3], L = end - lo;
  const int g = c.first[k1] - c.first[k0];  // the item's heads, kv head by kv head
  if (g == 0 || L <= 0) return;
  const int* heads = c.order.data() + c.first[k0];
  const int64_t* table = c.meta + 4 * int64_t(c.nrows) + m[1];
  const int64_t kstride = int64_t(c.nkv) * hd;  // elements from one position to the next
  const T* Q = static_cast<const T*>(c.q) + row * c.nq * hd;
  T* O = static_cast<T*>(c.out) + row * c.nq * hd;

  float* __restrict qf = scratch;  // [g, hd]
  float* __restrict buf = qf + g * hd;  // [TILE, hd]: a bfloat16 tile widened
  float* __restrict acc = buf + TILE * hd;  // [g, hd]
  float* __restrict denom = acc + g * hd;  // [g]
  float* __restrict s = denom + g;  // [g, L]: scores, then probabilities
  for (int i = 0; i < g; ++i)
    for (int d = 0; d < hd; ++d) qf[i * hd + d] = widen(Q[heads[i] * hd + d]);

  // pass 1: scores, a tile of up to 16 positions (never across a block) at a time, each
  // position's kv heads side by side in the cache
  for (int64_t j = lo; j < end;) {
    const int64_t off = j % bs;
    const int n = int(std::min<int64_t>({TILE, bs - off, end - j}));
    const T* kb = static_cast<const T*>(c.k) + (table[j / bs] * bs + off) * kstride;
    if (off + n == bs && j + n < end)  // the last tile of a block: fetch the next block
      prefetch(static_cast<const T*>(c.k) + table[j / bs + 1] * bs * kstride + k0 * hd,
               int(std::min<int64_t>(bs, end - j - n)), kstride, int64_t(k1 - k0) * hd);
    for (int kv = k0, i = 0; kv < k1; ++kv) {
      int64_t st;
      const float* kf = rows(kb + int64_t(kv) * hd, n, kstride, hd, buf, &st, kstride);
      for (const int i1 = c.first[kv + 1] - c.first[k0]; i < i1; ++i)
        for (int t = 0; t < n; ++t)
          s[i * L + (j - lo) + t] = dot<HD>(qf + i * hd, kf + t * st, hd) * c.scale;
    }
    j += n;
  }
  // pass 2: p = exp(score - max), the denominator in 16 lanes then a fixed tree
  for (int i = 0; i < g; ++i) {
    float* si = s + i * L;
    float mx = si[0];
    for (int64_t j = 1; j < L; ++j) mx = si[j] > mx ? si[j] : mx;
    for (int64_t j = 0; j < L; ++j) si[j] = exp_neg(si[j] - mx);
    float lane[LANES] = {};
    int64_t j = 0;
    for (; j + LANES <= L; j += LANES)
      for (int l = 0; l < LANES; ++l) lane[l] += si[j + l];
    for (int l = 0; j + l < L; ++l) lane[l] += si[j + l];
    for (int w = LANES / 2; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
    denom[i] = lane[0];
  }
  // pass 3: out = sum_j p_j v_j, each element summed over the keys in order
  std::fill(acc, acc + g * hd, 0.0f);
  for (int64_t j = lo; j < end;) {
    const int64_t off = j % bs;
    const int n = int(std::min<int64_t>({TILE, bs - off, end - j}));
    const T* vb = static_cast<const T*>(c.v) + (table[j / bs] * bs + off) * kstride;
    if (off + n == bs && j + n < end)
      prefetch(static_cast<const T*>(c.v) + table[j / bs + 1] * bs * kstride + k0 * hd,
               int(std::min<int64_t>(bs, end - j - n)), kstride, int64_t(k1 - k0) * hd);
    for (int kv = k0, i = 0; kv < k1; ++kv) {
      int64_t st;
      const float* vf = rows(vb + int64_t(kv) * hd, n, kstride, hd, buf, &st, kstride);
      for (const int i1 = c.first[kv + 1] - c.first[k0]; i < i1; ++i)
        axpy_tile<HD>(acc + i * hd, s + i * L + (j - lo), vf, st, n, hd);
    }
    j += n;
  }
  for (int i = 0; i < g; ++i)
    for (int d = 0; d < hd; ++d) narrow(acc[i * hd + d] / denom[i], O + heads[i] * hd + d);
}

// Work items: whole rows (every kv head: each position's keys read as one contiguous
// run) when there are at least as many rows as threads, else (row, kv head). Either way
// each (row, head) is computed whole, in the same order, by one thread.
template <typename T>
void run(const Call& c, int threads) {
  int64_t keys = 0;
  for (int r = 0; r < c.nrows; ++r) keys += c.meta[4 * r + 3] - c.meta[4 * r + 2];
  const int64_t work = 2 * keys * c.nq * c.hd;
  int nt = work >= THREAD_WORK ? std::max(1, threads) : 1;
  const int per_row = c.nrows >= nt ? 1 : c.nkv;  // items per row
  const int64_t items = int64_t(c.nrows) * per_row;
  nt = int(std::min<int64_t>(nt, items));
  const size_t need = size_t((2 * c.nq + TILE + 1) * c.hd + c.nq + c.nq * c.max_len);
  std::atomic<int64_t> next{0};
  auto worker = [&c, &next, items, need, per_row]() {
    std::vector<float> scratch(need);
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t r = w / per_row;
      const int k0 = per_row == 1 ? 0 : int(w % per_row), k1 = per_row == 1 ? c.nkv : k0 + 1;
      if (c.hd == 64)
        item<T, 64>(c, r, k0, k1, scratch.data());
      else if (c.hd == 128)
        item<T, 128>(c, r, k0, k1, scratch.data());
      else
        item<T, 0>(c, r, k0, k1, scratch.data());
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < nt; ++i) {
    try {
      pool.emplace_back(worker);
    } catch (...) {  // no thread to be had: the others (and this one) do the work
      break;
    }
  }
  worker();
  for (auto& t : pool) t.join();
}

}  // namespace

extern "C" {

// 0: done; -1: a dtype it does not take (0 float32, 1 bfloat16); -2: a query head maps
// to no local kv head.
int tpk_paged_attention(const void* q, const void* k, const void* v, void* out,
                        const int64_t* meta, const int32_t* kv_map, int nrows, int nq,
                        int nkv, int hd, int bs, int dtype, int threads) {
  Call c{q, k, v, out, meta, kv_map, nrows, nq, nkv, hd, bs,
         float(1.0 / std::sqrt(double(hd))), {}, std::vector<int>(nkv + 1, 0), 0};
  for (int h = 0; h < nq; ++h) {
    if (kv_map[h] < 0 || kv_map[h] >= nkv) return -2;
    ++c.first[kv_map[h] + 1];
  }
  for (int kv = 0; kv < nkv; ++kv) c.first[kv + 1] += c.first[kv];
  for (int kv = 0; kv < nkv; ++kv)
    for (int h = 0; h < nq; ++h)
      if (kv_map[h] == kv) c.order.push_back(h);
  for (int r = 0; r < nrows; ++r)
    c.max_len = std::max(c.max_len, meta[4 * r + 3] - meta[4 * r + 2]);
  if (dtype == 0)
    run<float>(c, threads);
  else if (dtype == 1)
    run<uint16_t>(c, threads);
  else
    return -1;
  return 0;
}

}  // extern "C"
