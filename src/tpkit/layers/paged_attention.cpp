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
constexpr int64_t THREAD_WORK = 1 << 20;  // q.k and p.v multiply-adds before threads pay

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
  std::vector<std::vector<int>> heads;  // kv head -> its query heads
  int64_t max_len;
};

template <typename T>
void item(const Call& c, int64_t w, float* __restrict scratch) {
  const int64_t* m = c.meta + 4 * (w / c.nkv);
  const int kvh = int(w % c.nkv);
  const std::vector<int>& heads = c.heads[kvh];
  const int g = int(heads.size()), hd = c.hd, bs = c.bs;
  const int64_t row = m[0], lo = m[2], end = m[3], L = end - lo;
  if (g == 0 || L <= 0) return;
  const int64_t* table = c.meta + 4 * int64_t(c.nrows) + m[1];
  const int64_t kstride = int64_t(c.nkv) * hd;  // elements from one position to the next
  const T* K = static_cast<const T*>(c.k) + int64_t(kvh) * hd;
  const T* V = static_cast<const T*>(c.v) + int64_t(kvh) * hd;
  const T* Q = static_cast<const T*>(c.q) + row * c.nq * hd;
  T* O = static_cast<T*>(c.out) + row * c.nq * hd;

  float* __restrict qf = scratch;  // [g, hd]
  float* __restrict kt = qf + g * hd;  // [hd, TILE]: a tile of keys, transposed
  float* __restrict vf = kt + hd * TILE;  // [hd]: one value row
  float* __restrict acc = vf + hd;  // [g, hd]
  float* __restrict s = acc + g * hd;  // [g, L]: scores, then probabilities
  for (int i = 0; i < g; ++i)
    for (int d = 0; d < hd; ++d) qf[i * hd + d] = widen(Q[heads[i] * hd + d]);

  // pass 1: scores, a tile of up to 16 keys (never across a block) at a time
  for (int64_t j = lo; j < end;) {
    const int64_t off = j % bs;
    const int n = int(std::min<int64_t>({TILE, bs - off, end - j}));
    const T* kb = K + (table[j / bs] * bs + off) * kstride;
    for (int d = 0; d < hd; ++d)
      for (int t = 0; t < TILE; ++t) kt[d * TILE + t] = t < n ? widen(kb[t * kstride + d]) : 0.0f;
    for (int i = 0; i < g; ++i) {
      float sc[TILE] = {};
      const float* qi = qf + i * hd;
      for (int d = 0; d < hd; ++d)
        for (int t = 0; t < TILE; ++t) sc[t] += qi[d] * kt[d * TILE + t];
      float* si = s + i * L + (j - lo);
      for (int t = 0; t < n; ++t) si[t] = sc[t] * c.scale;
    }
    j += n;
  }
  // pass 2: p = exp(score - max), the denominator in 16 lanes then a fixed tree
  float denom[32];
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
    for (int w2 = LANES / 2; w2 >= 1; w2 /= 2)
      for (int l = 0; l < w2; ++l) lane[l] += lane[l + w2];
    denom[i] = lane[0];  // g <= 32: checked by the caller
  }
  // pass 3: out = sum_j p_j v_j, in key order, each element its own sum
  std::fill(acc, acc + g * hd, 0.0f);
  for (int64_t j = lo; j < end; ++j) {
    const T* vb = V + (table[j / bs] * bs + j % bs) * kstride;
    for (int d = 0; d < hd; ++d) vf[d] = widen(vb[d]);
    for (int i = 0; i < g; ++i) {
      const float p = s[i * L + (j - lo)];
      float* ai = acc + i * hd;
      for (int d = 0; d < hd; ++d) ai[d] += p * vf[d];
    }
  }
  for (int i = 0; i < g; ++i)
    for (int d = 0; d < hd; ++d) narrow(acc[i * hd + d] / denom[i], O + heads[i] * hd + d);
}

template <typename T>
void run(const Call& c, int threads) {
  const int64_t items = int64_t(c.nrows) * c.nkv;
  int64_t keys = 0;
  for (int r = 0; r < c.nrows; ++r) keys += c.meta[4 * r + 3] - c.meta[4 * r + 2];
  const int64_t work = 2 * keys * c.nq * c.hd;
  int64_t gmax = 0;
  for (const auto& h : c.heads) gmax = std::max<int64_t>(gmax, int64_t(h.size()));
  const size_t need = size_t((2 * gmax + TILE + 1) * c.hd + gmax * c.max_len);
  std::atomic<int64_t> next{0};
  auto worker = [&c, &next, items, need]() {
    std::vector<float> scratch(need);
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < items;)
      item<T>(c, w, scratch.data());
  };
  int nt = work >= THREAD_WORK ? int(std::min<int64_t>(threads, items)) : 1;
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
// to no local kv head, or more than 32 query heads share one.
int tpk_paged_attention(const void* q, const void* k, const void* v, void* out,
                        const int64_t* meta, const int32_t* kv_map, int nrows, int nq,
                        int nkv, int hd, int bs, int dtype, int threads) {
  Call c{q, k, v, out, meta, kv_map, nrows, nq, nkv, hd, bs,
         float(1.0 / std::sqrt(double(hd))), std::vector<std::vector<int>>(nkv), 0};
  for (int h = 0; h < nq; ++h) {
    if (kv_map[h] < 0 || kv_map[h] >= nkv) return -2;
    c.heads[kv_map[h]].push_back(h);
  }
  for (const auto& h : c.heads)
    if (h.size() > 32) return -2;
  for (int r = 0; r < nrows; ++r) c.max_len = std::max(c.max_len, meta[4 * r + 3] - meta[4 * r + 2]);
  if (dtype == 0)
    run<float>(c, threads);
  else if (dtype == 1)
    run<uint16_t>(c, threads);
  else
    return -1;
  return 0;
}

}  // extern "C"
