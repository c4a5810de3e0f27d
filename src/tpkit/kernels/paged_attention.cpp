// Decode attention over a paged KV cache (called through ctypes: kernels/paged_attention.py).
//
// For every decode row r (one query token) and every local query head h:
//   out[row_r, h, :] = softmax(q[row_r, h, :] . K^T * scale) V
// over that row's keys lo_r <= j < end_r, key j read in place from the flat cache
//   k, v [positions, nkv, hd], position = table_r[j / bs] * bs + j % bs
// with the kv head kv_map[h] (GQA: a plain group or an uneven mapping); scale = 1/sqrt(hd).
//
// Batch invariance by construction: a work item is (row, chunk of 512 keys) for every
// head, computed whole by one thread in an order fixed by the row's own keys: each score
// a dot product in 16 lanes over d (lane l sums d = l, l + 16, ... in order) then a fixed
// tree, the softmax's denominator in 16 lanes (j % 16) then a fixed tree, each output
// element summed over j in order; a row's chunks then merged in chunk order (one chunk:
// the division alone). Nothing depends on the other rows, on the number of threads, or
// on where the blocks lie.
//
// Softmax in two passes per chunk: every score stored, their max, then exp(score - max)
// (a vectorisable Cephes-style exp, ~1 ulp). float32 or bfloat16 caches and queries
// (bfloat16: widened exactly to float, float accumulation, the output rounded to
// nearest even once). Threads over the work items only when the call's work is above
// THREAD_WORK multiply-adds: torch's own OpenMP team where the process has one (never a
// second OpenMP runtime), else std::threads above SPAWN_WORK. The next block of a row is
// prefetched (blocks lie anywhere: the hardware prefetcher cannot follow the table).
#include <algorithm>
#include <cstdlib>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <dlfcn.h>
#include <thread>
#include <vector>

#include "native_common.h"

namespace {

constexpr int TILE = 16;  // keys per score tile (the lanes of the score loop)
constexpr int LANES = 16;  // lanes of a dot product and of the softmax denominator's sum
constexpr int64_t CHUNK = 512;  // keys per work item (a row's chunks: fixed by its keys)
constexpr int64_t THREAD_WORK = 1 << 20;  // multiply-adds before torch's pool pays
constexpr int64_t SPAWN_WORK = 1 << 22;  // ... before threads of our own pay

struct Call {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int64_t* meta;  // [nrows, 4]: row, table offset, lo, end; then the tables
  const int32_t* kv_map;  // [nq]
  int nrows, nq, nkv, hd, bs;
  int64_t qstride;  // elements from one row of q to the next (its heads contiguous)
  float scale;
  std::vector<int> order;  // the query heads sorted by kv head (stable)
  std::vector<int> first;  // [nkv + 1]: kv head kv's heads are order[first[kv]:first[kv+1]]
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

// One work item: keys lo + CHUNK * chunk .. (at most CHUNK of them) of row r, every
// query head: its max score, sum of exp(score - max) and unnormalised output go to
// part [nq, hd + 2] (heads in kv order).
template <typename T, int HD>
void item(const Call& c, int64_t r, int64_t chunk, float* __restrict part,
          float* __restrict scratch) {
  const int64_t* m = c.meta + 4 * r;
  const int hd = HD > 0 ? HD : c.hd, bs = c.bs, g = c.nq;
  const int64_t lo = m[2] + CHUNK * chunk, end = std::min(m[3], lo + CHUNK), L = end - lo;
  const int64_t* table = c.meta + 4 * int64_t(c.nrows) + m[1];
  const int64_t kstride = int64_t(c.nkv) * hd;  // elements from one position to the next
  const int len = c.nkv * hd;  // a position's keys (or values): one contiguous run
  const T* Q = static_cast<const T*>(c.q) + m[0] * c.qstride;

  float* __restrict qf = scratch;  // [g, hd]
  float* __restrict buf = qf + g * hd;  // [TILE, hd]: a bfloat16 tile widened
  float* __restrict s = buf + TILE * hd;  // [g, CHUNK]: scores, then probabilities
  for (int i = 0; i < g; ++i)
    for (int d = 0; d < hd; ++d) qf[i * hd + d] = widen(Q[c.order[i] * hd + d]);

  // pass 1: scores, a tile of up to 16 positions (never across a block) at a time
  for (int64_t j = lo; j < end;) {
    const int64_t off = j % bs;
    const int n = int(std::min<int64_t>({TILE, bs - off, end - j}));
    const T* kb = static_cast<const T*>(c.k) + (table[j / bs] * bs + off) * kstride;
    if (off + n == bs && j + n < end)  // the last tile of a block: fetch the next block
      prefetch(static_cast<const T*>(c.k) + table[j / bs + 1] * bs * kstride,
               int(std::min<int64_t>(bs, end - j - n)), kstride, len);
    for (int kv = 0, i = 0; kv < c.nkv; ++kv) {
      int64_t st;
      const float* kf = rows(kb + int64_t(kv) * hd, n, kstride, hd, buf, &st, kstride);
      for (; i < c.first[kv + 1]; ++i)
        for (int t = 0; t < n; ++t)
          s[i * CHUNK + (j - lo) + t] = dot<HD>(qf + i * hd, kf + t * st, hd) * c.scale;
    }
    j += n;
  }
  // pass 2: p = exp(score - max), their sum in 16 lanes then a fixed tree
  for (int i = 0; i < g; ++i) {
    float* si = s + i * CHUNK;
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
    part[i * (hd + 2)] = mx;
    part[i * (hd + 2) + 1] = lane[0];
    std::fill(part + i * (hd + 2) + 2, part + (i + 1) * (hd + 2), 0.0f);
  }
  // pass 3: sum_j p_j v_j, each element summed over the keys in order
  for (int64_t j = lo; j < end;) {
    const int64_t off = j % bs;
    const int n = int(std::min<int64_t>({TILE, bs - off, end - j}));
    const T* vb = static_cast<const T*>(c.v) + (table[j / bs] * bs + off) * kstride;
    if (off + n == bs && j + n < end)
      prefetch(static_cast<const T*>(c.v) + table[j / bs + 1] * bs * kstride,
               int(std::min<int64_t>(bs, end - j - n)), kstride, len);
    for (int kv = 0, i = 0; kv < c.nkv; ++kv) {
      int64_t st;
      const float* vf = rows(vb + int64_t(kv) * hd, n, kstride, hd, buf, &st, kstride);
      for (; i < c.first[kv + 1]; ++i)
        axpy_tile<HD>(part + i * (hd + 2) + 2, s + i * CHUNK + (j - lo), vf, st, n, hd);
    }
    j += n;
  }
}

// Row r's output from its chunks' parts, merged in chunk order: with M the largest max,
// out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c (one chunk: acc / l exactly).
template <typename T>
void merge(const Call& c, int64_t r, const float* part, int64_t chunks, float* num) {
  const int hd = c.hd, w = hd + 2;
  T* O = static_cast<T*>(c.out) + c.meta[4 * r] * c.nq * hd;
  for (int i = 0; i < c.nq; ++i) {
    const float* pi = part + i * w;
    float M = pi[0];
    for (int64_t ch = 1; ch < chunks; ++ch) M = std::max(M, pi[ch * c.nq * w]);
    float den = 0.0f;
    std::fill(num, num + hd, 0.0f);
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const float* p = pi + ch * c.nq * w;
      const float e = exp_neg(p[0] - M);
      den += e * p[1];
      for (int d = 0; d < hd; ++d) num[d] += e * p[2 + d];
    }
    for (int d = 0; d < hd; ++d) narrow(num[d] / den, O + c.order[i] * hd + d);
  }
}

// Work items: (row, chunk of CHUNK keys), each computed whole by one thread; a row's
// chunks are fixed by its own keys, so its bits never depend on the threads or rows.
template <typename T>
void run(const Call& c, int threads) {
  std::vector<int64_t> first(c.nrows + 1, 0);  // row r's items: first[r] .. first[r + 1]
  int64_t keys = 0;
  for (int r = 0; r < c.nrows; ++r) {
    const int64_t L = std::max<int64_t>(c.meta[4 * r + 3] - c.meta[4 * r + 2], 0);
    keys += L;
    first[r + 1] = first[r] + (L + CHUNK - 1) / CHUNK;
  }
  const int64_t items = first[c.nrows], w = c.nq * int64_t(c.hd + 2);
  std::vector<float> part(size_t(items * w));
  const int64_t work = 2 * keys * c.nq * c.hd;
  const GompParallel pool = threads > 0 ? gomp_parallel() : nullptr;  // < 0: our own
  const int64_t enough = pool != nullptr ? THREAD_WORK : SPAWN_WORK;
  const int nt = int(std::min<int64_t>(work >= enough ? std::max(1, std::abs(threads)) : 1, items));
  const size_t need = size_t((c.nq + TILE + 1) * c.hd + c.nq * CHUNK);
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    std::vector<float> scratch(need);
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t r = std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1;
      float* p = part.data() + it * w;
      if (c.hd == 64)
        item<T, 64>(c, r, it - first[r], p, scratch.data());
      else if (c.hd == 128)
        item<T, 128>(c, r, it - first[r], p, scratch.data());
      else
        item<T, 0>(c, r, it - first[r], p, scratch.data());
    }
  };
  if (nt > 1 && pool != nullptr) {
    pool(&call<decltype(worker)>, &worker, unsigned(nt), 0);  // on torch's team; joins
  } else {
    std::vector<std::thread> own;
    for (int i = 1; i < nt; ++i) {
      try {
        own.emplace_back(worker);
      } catch (...) {  // no thread to be had: the others (and this one) do the work
        break;
      }
    }
    worker();
    for (auto& t : own) t.join();
  }
  std::vector<float> num(c.hd);
  for (int r = 0; r < c.nrows; ++r)
    if (first[r + 1] > first[r]) merge<T>(c, r, part.data() + first[r] * w, first[r + 1] - first[r], num.data());
}

}  // namespace

extern "C" {

// 1 if calls run on torch's OpenMP team (GOMP_parallel found in the process), else 0.
int tpk_paged_attention_pool() { return gomp_parallel() != nullptr; }

// 0: done; -1: a dtype it does not take (0 float32, 1 bfloat16); -2: a query head maps
// to no local kv head. threads: at most that many on torch's team where the process has
// one; -n: n std::threads of its own (the fallback, forced: for the tests). qstride:
// elements from one row of q to the next (<= 0: nq * hd, q contiguous).
int tpk_paged_attention(const void* q, const void* k, const void* v, void* out,
                        const int64_t* meta, const int32_t* kv_map, int nrows, int nq,
                        int nkv, int hd, int bs, int dtype, int threads, int64_t qstride) {
  Call c{q, k, v, out, meta, kv_map, nrows, nq, nkv, hd, bs,
         qstride > 0 ? qstride : int64_t(nq) * hd, float(1.0 / std::sqrt(double(hd))), {},
         std::vector<int>(nkv + 1, 0)};
  for (int h = 0; h < nq; ++h) {
    if (kv_map[h] < 0 || kv_map[h] >= nkv) return -2;
    ++c.first[kv_map[h] + 1];
  }
  for (int kv = 0; kv < nkv; ++kv) c.first[kv + 1] += c.first[kv];
  for (int kv = 0; kv < nkv; ++kv)
    for (int h = 0; h < nq; ++h)
      if (kv_map[h] == kv) c.order.push_back(h);
  if (dtype == 0)
    run<float>(c, threads);
  else if (dtype == 1)
    run<uint16_t>(c, threads);
  else
    return -1;
  return 0;
}

}  // extern "C"
