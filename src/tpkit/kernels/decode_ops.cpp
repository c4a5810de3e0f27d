// A decode step's native kernels (called through ctypes: kernels/decode_ops.py): the
// products of a few rows (tpk_linear), the norms (tpk_norm), the rotary embedding with
// the KV-cache write (tpk_rope_write).
//
// tpk_linear: y[m, n] = res[m, n] + (sum_k x[m, k] w[n, k] * scale[n] + bias[n]), m < M
// w [N, K] float32, bfloat16 or int8 (scale [N]: int8's row scales, else none), streamed
// once for all M rows; x, y, bias, res float32 or bfloat16; every sum float32, y rounded
// once. Gated (SwiGLU's fused [gate; up] weight of 2F rows): y[m, j] = silu(g) * u with g
// row j's sum, u row F + j's, y [M, F]. Or an activation of y (GELU, ReLU: fc1's, in the
// item that computed it, while the next rows stream in), y rounded first as if it were
// applied to the stored product afterwards (the same bits).
//
// Batch invariance by construction: y[m, n] is one dot product summed in a fixed order
// (U accumulators of L lanes by fused multiply-adds, a fixed tree, the K % L last terms
// in order), then scale, bias and res: the same whatever M, whatever the thread count or
// which thread computes it. L is the vector width (16 with AVX-512, else 8): the bits
// are this machine's, not another's.
//
// Threads: torch's own OpenMP team (GOMP_parallel, like the paged attention) above
// THREAD_WORK multiply-adds, work items of ITEM output columns taken in any order, each
// computed whole by one thread (its weight rows read a few at a time, each a stream from
// memory: `sums`).

#include "decode_simd.h"

namespace {

constexpr int64_t ITEM = 32;  // output columns per work item
constexpr int U = 2;  // accumulators per dot product
constexpr int64_t PREFETCH = 1024;  // bytes ahead a weight row is asked for (measured:
                                    // bfloat16 at one row 14% faster, float32 unchanged)
constexpr int64_t THREAD_WORK = 1 << 15;  // multiply-adds before torch's team pays

struct Call {
  const float* x;  // [M, K] float32 (bfloat16 inputs widened first)
  const void* w;
  const float* scale;  // [N] or null
  const void* bias;  // [N] in y's dtype, or null
  void* y;
  int64_t M, K, N, F;  // F: y's columns (N, or N / 2 gated)
  int gate;
  int act;  // 0 none, else y = act(round(y)) (no res then): 1 GELU (tanh), 2 GELU (erf), 3 ReLU
  const void* res;  // [M, F] in y's dtype, added last, or null
  int threads;  // torch's thread count (GELU's: `activate`)
};

// R weight rows (w[r], each [K]) against C input rows (x, stride K): s[r * C + c]. Each
// dot product in U accumulators of L lanes (element k goes to accumulator (k / L) % U,
// lane k % L; the last whole vectors after the last full U L step to accumulator 0), in
// order of k; then a0 + a1, the fixed tree over the lanes, and the K % L last products
// in order: the same order whatever R and C (which only share the loads).
template <class W, int R, int C>
inline void dots(const float* x, const W* const* w, int64_t K, float* s) {
  vf acc[R][C][U];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int u = 0; u < U; ++u) acc[r][c][u] = vf{};
  int64_t k = 0;
  for (; k + U * L <= K; k += U * L) {
    if ((k * sizeof(W)) % 64 == 0)  // a line at a time, PREFETCH bytes ahead in each row
      for (int r = 0; r < R; ++r) __builtin_prefetch(w[r] + k + PREFETCH / int64_t(sizeof(W)));
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r) {
        const vf wv = load(w[r] + k + u * L);
        for (int c = 0; c < C; ++c) acc[r][c][u] += wv * load(x + c * K + k + u * L);
      }
  }
  for (; k + L <= K; k += L)
    for (int r = 0; r < R; ++r) {
      const vf wv = load(w[r] + k);
      for (int c = 0; c < C; ++c) acc[r][c][0] += wv * load(x + c * K + k);
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float t = tree(acc[r][c][0] + acc[r][c][1]);
      for (int64_t j = k; j < K; ++j) t += x[c * K + j] * widen(w[r][j]);
      s[r * C + c] = t;
    }
}

template <class W, class Y>
inline float finish(const Call& c, int64_t n, float s) {
  if (c.scale != nullptr) s *= c.scale[n];
  if (c.bias != nullptr) s += widen(static_cast<const Y*>(c.bias)[n]);
  return s;
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// GELU (tanh) as torch computes it on this CPU, bit for bit (ATen's Gelu.h through
// cpu_kernel_vec): x^3 = x x x, inner = beta (x + kappa x^3), 0.5 x (1 + tanh(inner)),
// with Sleef's tanh (libtorch_cpu's own, L lanes) on the elements torch's vector loop
// takes and std::tanh on the rest (-inf gives NaN, as torch's). Which elements
// (`torch_chunk`): torch runs its loop over the flattened output [M, F], in one chunk a
// thread above 16384 elements, each chunk's last (its length mod two vectors) elements
// scalar. Multiply-adds fused as torch's build fuses them (tested: F.gelu's bits).
// Before, std::tanh on every element (in another order, whose bits were not torch's: ~8%
// of GPT-2's activations 1 ulp apart) took 11% of a decode step of 8 rows; now 3%. Without
// torch's Sleef every element is scalar.
constexpr double kGeluBeta = M_SQRT2 * M_2_SQRTPI * 0.5, kGeluKappa = 0.044715;
using VecFn = vf (*)(vf);
VecFn sleef_tanh() {
  static const VecFn f = [] {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    void* sym = lib ? dlsym(lib, L == 16 ? "Sleef_tanhf16_u10" : "Sleef_tanhf8_u10") : nullptr;
    return reinterpret_cast<VecFn>(sym);
  }();
  return f;
}

__attribute__((optimize("fp-contract=fast")))
float gelu_one(float x) {
  const float cube = x * x * x;
  const float inner = float(kGeluBeta) * (x + float(kGeluKappa) * cube);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

// An activation of one value: 1 GELU (tanh, gelu_one), 2 GELU (erf; the products in the
// order written, none fused), 3 ReLU.
__attribute__((optimize("fp-contract=off")))
float act_one(float v, int act) {
  if (act == 1) return gelu_one(v);
  if (act == 2) return 0.5f * v * (1.0f + std::erf(v * 0.7071067811865476f));
  return v > 0.0f ? v : 0.0f;
}

__attribute__((optimize("fp-contract=fast")))
vf gelu_lanes(vf x, VecFn tanh_lanes) {
  const vf cube = x * x * x;
  const vf inner = float(kGeluBeta) * (x + float(kGeluKappa) * cube);
  return 0.5f * x * (1.0f + tanh_lanes(inner));
}

// Where torch's elementwise loop over n elements of a dtype of `bytes` switches to its
// scalar tail, for the element i: the end of the vector loop of i's chunk (two vectors
// of L float32 lanes' bytes a step) and the chunk's end, at `threads` threads.
inline void torch_chunk(int64_t i, int64_t n, int threads, int64_t bytes, int64_t* vec_end,
                        int64_t* end) {
  int64_t chunk = n;
  if (n > 16384 && threads > 1) {  // GELU's grain: n / threads, one chunk a thread
    const int64_t grain = n / threads, parts = std::min<int64_t>(threads, (n + grain - 1) / grain);
    chunk = (n + parts - 1) / parts;
  }
  const int64_t start = i / chunk * chunk, len = std::min(n, start + chunk) - start;
  *vec_end = start + len - len % (2 * L * 4 / bytes);
  *end = start + len;
}

// The activation of o[0 .. n) (elements i0 .. i0 + n of y flattened), each rounded to Y
// first (as if applied to the stored product).
template <class Y>
void activate(const Call& c, float* o, int64_t n, int64_t i0) {
  for (int64_t j = 0; j < n; ++j) {
    Y r;
    narrow(o[j], &r);
    o[j] = widen(r);
  }
  const VecFn tanh_lanes = c.act == 1 ? sleef_tanh() : nullptr;
  if (tanh_lanes == nullptr) {
    for (int64_t j = 0; j < n; ++j) o[j] = act_one(o[j], c.act);
    return;
  }
  float lanes[2 * ITEM + L];  // the vector loop's elements, packed (any lane: elementwise)
  int64_t at[2 * ITEM], k = 0, vec_end = 0, end = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (i0 + j >= end) torch_chunk(i0 + j, c.M * c.F, c.threads, sizeof(Y), &vec_end, &end);
    if (i0 + j < vec_end) {
      lanes[k] = o[j];
      at[k++] = j;
    } else {
      o[j] = gelu_one(o[j]);
    }
  }
  for (int64_t q = k; q % L; ++q) lanes[q] = 0.0f;
  for (int64_t q = 0; q < k; q += L) {
    const vf r = gelu_lanes(load(lanes + q), tanh_lanes);
    for (int64_t l = 0; l < L && q + l < k; ++l) o[at[q + l]] = r[l];
  }
}

// The sums of an item's weight rows at[0 .. rows) by C input rows x: s[i][c0 + c]. R rows
// at a time from far apart (row j with rows j + rows / R, ...: separate pages, so the
// prefetchers run R streams), R C U accumulators in registers. With AVX-512's 32: at one
// input row float32 8, bfloat16 4 (float32 4 -> 8: 3-4% faster at two threads; bfloat16
// 8: slower), int8 2 (its rows are short); at two 4 (int8 2); at four 3; at five or six
// 2 (bfloat16 only: `columns`). Measured on the Sapphire Rapids machine of
// docs/benchmarks.md against one stream at four rows and two at two (GPT-2's products,
// the head included): 0.71x the time at four and eight rows, 0.84-0.90x at two, float32
// and bfloat16, one thread or two; int8 0.83x at four. With
// AVX2's 16 (L = 8): 4 at one input row (float32 ~8% faster than 2; int8 2), 2 at two, 1
// at four. R only groups the loads: each sum's order is dots' whatever R.
template <class W, int C>
void sums(const float* x, const W* const* at, int64_t rows, int64_t K, float (*s)[8], int c0) {
  constexpr int R = L == 16 ? (C >= 5 ? 2 : C >= 4 ? 3 : sizeof(W) == 1 ? 2 : C == 2 || sizeof(W) == 2 ? 4 : 8)
                            : (C >= 4 ? 1 : C == 1 && sizeof(W) > 1 ? 4 : 2);
  const int64_t stride = rows / R;
  float t[R * C];
  for (int64_t j = 0; j < stride; ++j) {
    const W* r[R];
    for (int q = 0; q < R; ++q) r[q] = at[j + q * stride];
    dots<W, R, C>(x, r, K, t);
    for (int q = 0; q < R; ++q)
      for (int c = 0; c < C; ++c) s[j + q * stride][c0 + c] = t[q * C + c];
  }
  for (int64_t i = R * stride; i < rows; ++i) {
    dots<W, 1, C>(x, &at[i], K, t);
    for (int c = 0; c < C; ++c) s[i][c0 + c] = t[c];
  }
}

// Output columns f0 .. f1 (at most ITEM) of y for every input row, 8 input rows at a
// time. The item's weight rows (two a column gated: gate, up) are streamed from memory
// once each, several at once (`sums`), against up to 4 input rows at a time (the rest
// read them again from cache).
template <class W, class Y>
void columns(const Call& c, int64_t f0, int64_t f1) {
  const W* w = static_cast<const W*>(c.w);
  Y* y = static_cast<Y*>(c.y);
  const int64_t n = f1 - f0, rows = n * (1 + c.gate);
  float s[2 * ITEM][8];  // s[i][m - m0]: item row i (the gate or plain rows, then up), x row m
  const W* at[2 * ITEM];
  for (int64_t i = 0; i < rows; ++i)
    at[i] = w + (i < n ? f0 + i : c.F + f0 + i - n) * c.K;
  for (int64_t m0 = 0; m0 < c.M; m0 += 8) {
    const int64_t m1 = std::min(c.M, m0 + 8);
    for (int64_t m = m0; m < m1;) {
      const float* x = c.x + m * c.K;
      const int c0 = int(m - m0);
      if (sizeof(W) == 2 && (m1 - m == 5 || m1 - m == 6)) {  // bfloat16: widened once
        if (m1 - m == 5)  // for all (4 + 1 widened twice: a speculation step's 5th row
          sums<W, 5>(x, at, rows, c.K, s, c0);  // cost ~0.4 of a one-row step, now ~0.25)
        else
          sums<W, 6>(x, at, rows, c.K, s, c0);
        m = m1;
      } else if (m1 - m >= 4) {
        sums<W, 4>(x, at, rows, c.K, s, c0);
        m += 4;
      } else if (m1 - m >= 2) {
        sums<W, 2>(x, at, rows, c.K, s, c0);
        m += 2;
      } else {
        sums<W, 1>(x, at, rows, c.K, s, c0);
        m += 1;
      }
    }
    for (int64_t m = m0; m < m1; ++m) {
      float o[ITEM];
      for (int64_t j = 0; j < n; ++j) {
        const int64_t f = f0 + j;
        const float v = finish<W, Y>(c, f, s[j][m - m0]);
        o[j] = c.gate ? silu(v) * finish<W, Y>(c, c.F + f, s[n + j][m - m0]) : v;
      }
      if (c.act != 0) activate<Y>(c, o, n, m * c.F + f0);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t f = f0 + j;
        float v = o[j];
        if (c.res != nullptr) v = widen(static_cast<const Y*>(c.res)[m * c.F + f]) + v;
        narrow(v, y + m * c.F + f);
      }
    }
  }
}

template <class W, class Y>
void run(const Call& c, int threads) {
  const GompParallel pool = gomp_parallel();
  const int64_t work = c.M * c.N * c.K;
  const int nt = int(std::min<int64_t>(pool != nullptr && work >= THREAD_WORK ? std::max(threads, 1) : 1, c.F / 4 + 1));
  if (nt <= 1) {
    for (int64_t f = 0; f < c.F; f += ITEM) columns<W, Y>(c, f, std::min(c.F, f + ITEM));
    return;
  }
  const int64_t items = (c.F + ITEM - 1) / ITEM;
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;)
      columns<W, Y>(c, it * ITEM, std::min(c.F, (it + 1) * ITEM));
  };
  pool(&call<decltype(worker)>, &worker, unsigned(nt), 0);  // on torch's team; joins
}

template <class W>
int dispatch_y(const Call& c, int ydtype, int threads) {
  if (ydtype == 0)
    run<W, float>(c, threads);
  else if (ydtype == 1)
    run<W, uint16_t>(c, threads);
  else
    return -1;
  return 0;
}


// ---- norms ----------------------------------------------------------------------------
// Each row of x [M, H]: RMSNorm y = h / sqrt(mean(h^2) + eps) * (w + offset), or LayerNorm
// y = (h - mean) / sqrt(mean((h - mean)^2) + eps) * w + b, every sum float32 (L lanes in
// order of the elements, the fixed tree), y rounded once.
template <class T>
void norm_rows(const T* x, const T* w, const T* b, T* y, int64_t M, int64_t H, float eps,
               float offset, int layer) {
  std::vector<float> h(static_cast<size_t>(H));
  for (int64_t m = 0; m < M; ++m) {
    const T* xm = x + m * H;
    for (int64_t i = 0; i < H; ++i) h[i] = widen(xm[i]);
    float mean = 0.0f;
    if (layer) {
      mean = lanes_sum(h.data(), H, nullptr) / float(H);
      for (int64_t i = 0; i < H; ++i) h[i] -= mean;
    }
    const float inv = 1.0f / std::sqrt(lanes_sum(h.data(), H, h.data()) / float(H) + eps);
    T* ym = y + m * H;
    for (int64_t i = 0; i < H; ++i) {
      float v = h[i] * inv * (widen(w[i]) + offset);
      if (b != nullptr) v += widen(b[i]);
      narrow(v, ym + i);
    }
  }
}

// ---- rotary embedding and the cache write ---------------------------------------------
// Row t of heads (row stride S elements): its nr rotated heads (q then k), each's first rd
// dims by Llama's rotate-half, x * cos + rotate_half(x) * sin with rotate_half(x) =
// [-x2, x1], every product and sum rounded in float32 as torch's (no fused multiply-add),
// then rounded to T once; then its nkv k heads (the last rotated ones) and the nkv v heads
// after them copied into the cache k, v [positions, nkv, hd] at position write[t].
template <class T>
__attribute__((optimize("fp-contract=off")))
void rope_write(T* heads, int64_t rows, int64_t S, int nr, int nkv, int hd, const float* cos,
                const float* sin, int rd, const int64_t* write, T* ck, T* cv) {
  const int half = rd / 2;
  std::vector<float> x(static_cast<size_t>(rd));
  for (int64_t t = 0; t < rows; ++t) {
    T* row = heads + t * S;
    const float* c = cos + t * rd;
    const float* s = sin + t * rd;
    for (int h = 0; h < nr && rd > 0; ++h) {
      T* e = row + int64_t(h) * hd;
      for (int i = 0; i < rd; ++i) x[i] = widen(e[i]);
      for (int i = 0; i < half; ++i) {
        const float a = x[i] * c[i], r = -x[i + half] * s[i];
        narrow(a + r, e + i);
      }
      for (int i = half; i < rd; ++i) {
        const float a = x[i] * c[i], r = x[i - half] * s[i];
        narrow(a + r, e + i);
      }
    }
    if (write != nullptr) {
      const int64_t len = int64_t(nkv) * hd;
      std::memcpy(ck + write[t] * len, row + int64_t(nr - nkv) * hd, size_t(len) * sizeof(T));
      std::memcpy(cv + write[t] * len, row + int64_t(nr) * hd, size_t(len) * sizeof(T));
    }
  }
}

}  // namespace

extern "C" {

// 1 if calls run on torch's OpenMP team (GOMP_parallel found in the process), else 0.
int tpk_decode_ops_pool() { return gomp_parallel() != nullptr; }

// The vector width L (the lanes of every dot product).
int tpk_decode_ops_lanes() { return L; }

// dtypes: 0 float32, 1 bfloat16, 2 int8 (w only; needs scale). x, y: 0 or 1, one dtype
// (bias and res in it too; either may be null). epilogue: 1 for silu(gate) * up over w's
// two halves (N even); 2, 3, 4: act_one 1, 2, 3 of y (res null); else 0.
// 0: done; -1: a dtype it does not take; -2: bad sizes.
int tpk_linear(const void* x, const void* w, const float* scale, const void* bias,
               const void* res, void* y, int64_t M, int64_t K, int64_t N, int xdtype, int wdtype,
               int epilogue, int threads) {
  const int gate = epilogue == 1, act = epilogue >= 2 && epilogue <= 4 ? epilogue - 1 : 0;
  if (M < 0 || K <= 0 || N <= 0 || (gate && N % 2) || (act && res != nullptr)) return -2;
  if ((wdtype == 2) != (scale != nullptr)) return -1;
  std::vector<float> wide;
  const float* xf = static_cast<const float*>(x);
  if (xdtype == 1) {
    wide.resize(size_t(M * K));
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < M * K; ++i) wide[i] = widen(xb[i]);
    xf = wide.data();
  } else if (xdtype != 0) {
    return -1;
  }
  Call c{xf, w, scale, bias, y, M, K, N, gate ? N / 2 : N, gate, act, res, threads};
  if (M == 0) return 0;
  if (wdtype == 0) return dispatch_y<float>(c, xdtype, threads);
  if (wdtype == 1) return dispatch_y<uint16_t>(c, xdtype, threads);
  if (wdtype == 2) return dispatch_y<int8_t>(c, xdtype, threads);
  return -1;
}

// Rows of x [M, H] normalized (norm_rows): kind 0 RMSNorm, 1 LayerNorm (b may be null);
// dtype 0 float32, 1 bfloat16 (x, w, b, y alike). 0: done; -1: a dtype it does not take.
int tpk_norm(const void* x, const void* w, const void* b, void* y, int64_t M, int64_t H,
             float eps, float offset, int kind, int dtype) {
  if (dtype == 0)
    norm_rows(static_cast<const float*>(x), static_cast<const float*>(w),
              static_cast<const float*>(b), static_cast<float*>(y), M, H, eps, offset, kind);
  else if (dtype == 1)
    norm_rows(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
              static_cast<const uint16_t*>(b), static_cast<uint16_t*>(y), M, H, eps, offset, kind);
  else
    return -1;
  return 0;
}

// Rotary embedding of each row's first nr heads in place, then its k and v heads into the
// cache at write[t] (rope_write; write null: no cache write). cos, sin float32 [rows, rd].
int tpk_rope_write(void* heads, int64_t rows, int64_t S, int nr, int nkv, int hd,
                   const float* cos, const float* sin, int rd, const int64_t* write, void* ck,
                   void* cv, int dtype) {
  if (rd % 2 || rd > hd || nkv > nr) return -2;
  if (dtype == 0)
    rope_write(static_cast<float*>(heads), rows, S, nr, nkv, hd, cos, sin, rd, write,
               static_cast<float*>(ck), static_cast<float*>(cv));
  else if (dtype == 1)
    rope_write(static_cast<uint16_t*>(heads), rows, S, nr, nkv, hd, cos, sin, rd, write,
               static_cast<uint16_t*>(ck), static_cast<uint16_t*>(cv));
  else
    return -1;
  return 0;
}

// Each row of x [M, ld] float32 (a shard of a vocabulary's logits: columns first ..),
// over its first n columns: out[3 m..] = (its largest value, first + the first column
// holding it: a token id, log(sum exp(x - largest)) + largest): a greedy token and the
// log-sum-exp of its log-probability, in two passes over the row (in cache; the
// attention's exp_neg). A NaN counts as the largest (as torch's argmax). A shard of
// padding alone (first >= vocab) gives -inf, -inf: none of its columns can win.
// 0: done; -2: bad sizes.
int tpk_best(const float* x, int64_t M, int64_t n, int64_t ld, int64_t first, int64_t vocab,
             float* out) {
  if (M < 0 || n <= 0 || ld < n) return -2;
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ld;
    vf top = vf{} + row[0];  // each lane's largest and the first of its columns holding
    vi where = vi{}, pos;  // it (column 0 until a larger one)
    for (int l = 0; l < L; ++l) pos[l] = l;
    int64_t i = 0;
    for (; i + L <= n; i += L, pos += L) {
      const vf v = load(row + i);
      const vi more = v > top;
      top = more ? v : top;
      where = more ? pos : where;
    }
    float best = row[0];
    int64_t at = n;
    for (int l = 0; l < L; ++l) best = std::max(best, top[l]);
    for (int l = 0; l < L; ++l)
      if (top[l] == best) at = std::min<int64_t>(at, where[l]);
    for (; i < n; ++i)
      if (row[i] > best) best = row[i], at = i;
    vf acc = vf{};  // sum of exp(x - best) in L lanes, then the fixed tree
    float e[256];  // a tile of exponentials (a loop that vectorises)
    for (i = 0; i < n; i += 256) {
      const int64_t t = std::min<int64_t>(256, n - i);
      for (int64_t j = 0; j < t; ++j) e[j] = exp_neg(row[i + j] - best);
      for (int64_t j = t; j % L; ++j) e[j] = 0.0f;
      for (int64_t j = 0; j < t; j += L) acc += load(e + j);
    }
    const float sum = tree(acc);
    if (std::isnan(sum)) {  // a NaN somewhere (or best infinite): the first NaN
      int64_t nan = 0;
      while (nan < n && !std::isnan(row[nan])) ++nan;
      if (nan < n) best = row[nan], at = nan;
    }
    const bool padding = first >= vocab;
    out[3 * m] = padding ? -INFINITY : best;
    out[3 * m + 1] = float(at) + float(first);
    out[3 * m + 2] = padding ? -INFINITY : std::isinf(best) ? best : std::log(sum) + best;
  }
  return 0;
}

// A grammar's mask on tpk_best's rows: each row m of x (as tpk_best's) whose bitmask
// bits[m, :words] (bit t: token t allowed, over the whole vocabulary) is not all ones
// gets out[3 m], out[3 m + 1] = the largest value over its allowed columns and the first
// allowed column holding it (a NaN the largest; none above -inf: -inf at column 0, as
// torch's argmax of the row with -inf where not allowed); its log-sum-exp stays the
// model's (out[3 m + 2], over every column). L columns at a time (their L bits a lane
// mask) where the row holds no NaN (its log-sum-exp says), else column by column.
// 0: done; -2: bad sizes.
int tpk_allowed(const float* x, int64_t M, int64_t n, int64_t ld, int64_t first,
                const uint32_t* bits, int64_t words, float* out) {
  if (M < 0 || n <= 0 || ld < n || first < 0 || words <= 0) return -2;
  const int64_t end = std::min<int64_t>(n, words * 32 - first);  // columns with a bit
  const uint32_t low = L == 32 ? ~0u : (1u << L) - 1;
  vu lane;
  for (int l = 0; l < L; ++l) lane[l] = l;
  for (int64_t m = 0; m < M; ++m) {
    const uint32_t* b = bits + m * words;
    bool every = true;
    for (int64_t w = 0; w < words && every; ++w) every = b[w] == ~uint32_t(0);
    if (every) continue;
    const float* row = x + m * ld;
    float best = -INFINITY;
    int64_t at = 0, i = 0;
    if (!std::isnan(out[3 * m + 2])) {  // no NaN in the row: L lanes, each its first best
      vf top = vf{} - INFINITY;
      vi where = vi{}, pos;
      for (int l = 0; l < L; ++l) pos[l] = l;
      for (; i + L <= end; i += L, pos += L) {
        const int64_t t = first + i, w = t >> 5;
        const uint64_t pair = uint64_t(b[w]) | (w + 1 < words ? uint64_t(b[w + 1]) << 32 : 0);
        const uint32_t on = uint32_t(pair >> (t & 31)) & low;
        if (on == 0) continue;
        const vf v = load(row + i);
        const vi more = (((vu{} + on) >> lane) & 1u) != 0 & (v > top);
        top = more ? v : top;
        where = more ? pos : where;
      }
      for (int l = 0; l < L; ++l) best = std::max(best, top[l]);
      at = n;
      for (int l = 0; l < L; ++l)
        if (top[l] == best) at = std::min<int64_t>(at, where[l]);
    }
    for (; i < end; ++i) {  // the rest (or a row with a NaN: all of it)
      const int64_t t = first + i;
      if (!((b[t >> 5] >> (t & 31)) & 1u)) continue;
      if (std::isnan(row[i])) { best = row[i], at = i; break; }
      if (row[i] > best) best = row[i], at = i;
    }
    out[3 * m] = best;
    out[3 * m + 1] = float(at) + float(first);
  }
  return 0;
}

// Each row's greedy token and log-probability [T, 2] from every rank's best of its
// shard, every [tp, T, 3] (rank-major; tpk_best's, columns as token ids): the token of
// the first rank with the largest value (torch's argmax of the whole row), value -
// log(sum over the ranks of exp(their log-sum-exp)) (the largest first, so no overflow).
int tpk_pick(const float* every, int tp, int64_t T, float* out) {
  if (tp < 1 || T < 0) return -2;
  for (int64_t t = 0; t < T; ++t) {
    int win = 0;
    float top = every[3 * t], m = every[3 * t + 2];
    for (int r = 1; r < tp; ++r) {
      const float* b = every + 3 * (r * T + t);
      if (b[0] > top) top = b[0], win = r;
      m = std::max(m, b[2]);
    }
    float lse = m;
    if (tp > 1 && std::isfinite(m)) {
      float sum = 0.0f;
      for (int r = 0; r < tp; ++r) sum += std::exp(every[3 * (r * T + t) + 2] - m);
      lse = m + std::log(sum);
    }
    out[2 * t] = every[3 * (win * T + t) + 1];
    out[2 * t + 1] = top - lse;
  }
  return 0;
}

}  // extern "C"

#include "decode_layers.h"
