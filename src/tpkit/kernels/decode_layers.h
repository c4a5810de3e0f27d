// A stack of decode layers in one call (included once, by decode_ops.cpp, after the
// kernels it calls: tpk_norm, tpk_linear, tpk_rope_write).
#pragma once

#include <ctime>

namespace {

// ---- a stack of layers, one call -------------------------------------------------------
// Every layer of a pre-norm dense model on a decode's T rows x [T, H] (in place):
//   h = norm1(x); qkv = h Wqkv^T + b; rotate q, k and write k, v into the layer's cache;
//   y = attention (the paged kernel, called through `attend`); x = x + (y Wout^T + b);
//   h = norm2(x); a = silu(h G^T) * (h U^T) (or act(h W1^T + b)); x = x + (a W2^T + b)
// each step the kernel of the same name above (the same sums as the layer's calls one by
// one from Python: the same bits), the buffers in `work`. At tp > 1 each rank holds its
// shards (heads, fc1's columns, the products' rows) and the two row-parallel products
// are partial: the lead rank's carries x and the bias, then the all-reduce sums the
// ranks' in rank order, (x + b + p0) + p1 + ..., as `NativeLayer` does from Python.
struct Lin {
  const void* w;
  const float* scale;
  const void* bias;
  int64_t n, k;
  int wdtype;
};
struct Layer {
  const void* n1w;
  const void* n1b;
  const void* n2w;
  const void* n2b;
  float n1eps, n1off, n2eps, n2off;
  Lin qkv, out, fc1, fc2;
  int act;  // 0 SwiGLU (fc1 gated), 1 GELU (tanh), 2 GELU (erf), 3 ReLU
  int nq, nkv, hd;
  const int32_t* kv_map;
};
// What a greedy decode adds around the layers (`Step::ends`; a null pointer: not done).
// table: this rank's rows vstart .. vstart + vrows of the word embedding (x's dtype):
// each row's id looked up into x (an id another rank holds: zeros), summed over the
// group at tp > 1 (all-reduce 2n: numbered after the layers' 2n), then + ptable's row of
// its position (a learned position table, replicated). After the layers: the final norm
// (nw null: none), the head's shard [N, H] into logits [T, N] (x's dtype; wide: their
// float32 for bfloat16), its best [T, 3] (tpk_best over the first `valid` columns), at
// tp > 1 gathered from every rank into every [tp, T, 3] (`gather`: the channel's
// all-gather, number 2n + 1), and pick [T, 2]: each row's greedy token and
// log-probability (tpk_pick). mask (null: none): each row's grammar bitmask over the
// whole vocabulary, `words` 32-bit words a row, applied to its best (tpk_allowed).
using Gather = int (*)(void*, int, const void*, void*, size_t, double, int*);
struct Ends {
  const void* table;
  const void* ptable;
  const int64_t* ids;
  const int64_t* pos;
  int64_t vocab, vstart, vrows;
  const void* nw;
  const void* nb;
  float eps, off;
  Lin head;
  int64_t valid, first;
  void* logits;
  float* wide;
  float* best;
  Gather gather;
  int tp;
  float* every;
  float* pick;
  const uint32_t* mask;
  int64_t words;
};
using Reduce = int (*)(void*, int, void*, size_t, int, int, size_t, double, int*);
using Attend = int (*)(const void*, const void*, const void*, void*, const int64_t*,
                       const int32_t*, int, int, int, int, int, int, int, int64_t);
struct Step {
  int64_t T, H;
  int dtype, threads;
  const float* cos;  // [T, rd] each row's rotary angles, or (pos given) the table's rows
  const float* sin;  // [positions, rd] looked up at pos [T] into the work's end
  int rd;
  const int64_t* pos;
  const int64_t* write;
  void* const* ck;  // [layers]: each layer's cache
  void* const* cv;
  Attend attend;
  const int64_t* meta;
  int rows, bs, attend_threads;
  // tp > 1: the group's all-reduce after each row-parallel product (the shared-memory
  // channel's tpk_all_reduce and its arguments; null at tp=1). lead: this rank's partial
  // products carry the residual and the biases (the others' nothing). spans [2 n][2]:
  // each all-reduce's start and end (CLOCK_MONOTONIC seconds, time.perf_counter's clock);
  // failed: the index of the one that failed.
  Reduce reduce;
  void* rbase;
  int rrank, lead;
  size_t rsplit;
  double rtimeout;
  int* who;
  double* spans;
  int failed;
  const Ends* ends;
};

constexpr int REDUCE_FAILED = 1000;  // tpk_layers' code: this + the all-reduce's own

inline double monotonic() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// x [T, H] summed over the group in place (tp > 1; nothing at tp=1): all-reduce `at`.
inline int reduced(Step* s, void* x, int64_t numel, int at) {
  if (s->reduce == nullptr) return 0;
  s->spans[2 * at] = monotonic();
  const int rc = s->reduce(s->rbase, s->rrank, x, size_t(numel), s->dtype, 0, s->rsplit,
                           s->rtimeout, s->who);
  s->spans[2 * at + 1] = monotonic();
  if (rc == 0) return 0;
  s->failed = at;
  return REDUCE_FAILED + rc;
}

// Rows of x [T, H] from this rank's rows of the word embedding (Ends; another rank's
// id: zeros): -3 for an id outside the vocabulary.
template <class T>
int embed(T* x, const Ends& e, int64_t rows, int64_t H) {
  const T* table = static_cast<const T*>(e.table);
  for (int64_t t = 0; t < rows; ++t) {
    if (e.ids[t] < 0 || e.ids[t] >= e.vocab) return -3;
    const int64_t r = e.ids[t] - e.vstart;
    if (r >= 0 && r < e.vrows)
      std::memcpy(x + t * H, table + r * H, size_t(H) * sizeof(T));
    else
      std::memset(x + t * H, 0, size_t(H) * sizeof(T));
  }
  return 0;
}

// x [T, H] += each row's learned position (Ends::ptable), rounded once to x's dtype.
template <class T>
void positions(T* x, const Ends& e, int64_t rows, int64_t H) {
  const T* p = static_cast<const T*>(e.ptable);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t d = 0; d < H; ++d)
      narrow(widen(x[t * H + d]) + widen(p[e.pos[t] * H + d]), x + t * H + d);
}

// After the layers (Ends): the final norm of x into h, the head's logits, their best.
inline int head(const void* x, void* h, const Ends& e, int64_t T, int64_t H, int dtype,
                int threads) {
  const void* in = x;
  int rc = 0;
  if (e.nw != nullptr) {
    rc = tpk_norm(x, e.nw, e.nb, h, T, H, e.eps, e.off, e.nb != nullptr, dtype);
    in = h;
  }
  const Lin& w = e.head;
  rc = rc ? rc : tpk_linear(in, w.w, w.scale, w.bias, nullptr, e.logits, T, H, w.n, dtype,
                            w.wdtype, 0, threads);
  if (rc) return rc;
  const float* f = static_cast<const float*>(e.logits);
  if (dtype == 1) {
    const uint16_t* b = static_cast<const uint16_t*>(e.logits);
    for (int64_t i = 0; i < T * w.n; ++i) e.wide[i] = widen(b[i]);
    f = e.wide;
  }
  rc = tpk_best(f, T, e.valid, w.n, e.first, e.vocab, e.best);
  if (rc == 0 && e.mask != nullptr)
    rc = tpk_allowed(f, T, e.valid, w.n, e.first, e.mask, e.words, e.best);
  return rc;
}

}  // namespace

extern "C" {

// x [T, H] in place through n layers; work: T * (H + max over the layers of qkv.n +
// nq hd + fc1.n) elements of x's dtype, then (pos given) 2 T rd float32. With ends:
// x embedded first (table given; at tp > 1 all-reduce 2n), the head's best computed
// after (head.w given) and, pick given, the greedy tokens (at tp > 1 all-gather 2n + 1).
// 0: done; REDUCE_FAILED + the all-reduce's code where one failed (s->failed: which);
// else the first failing kernel's code (-3: a token id outside the embedding).
int tpk_layers(void* x, const Layer* layers, int n, Step* s, void* work) {
  const int64_t T = s->T, H = s->H;
  const size_t es = s->dtype == 0 ? 4 : 2;
  const bool lead = s->reduce == nullptr || s->lead;
  void* res = lead ? x : nullptr;
  const Ends* e = s->ends;
  if (e != nullptr && e->table != nullptr) {  // all-reduce 2n: the embedding's
    int rc = s->dtype == 0 ? embed(static_cast<float*>(x), *e, T, H)
                           : embed(static_cast<uint16_t*>(x), *e, T, H);
    rc = rc ? rc : reduced(s, x, T * H, 2 * n);
    if (rc) return rc;
    if (e->ptable != nullptr && s->dtype == 0) positions(static_cast<float*>(x), *e, T, H);
    if (e->ptable != nullptr && s->dtype == 1) positions(static_cast<uint16_t*>(x), *e, T, H);
  }
  const float* cos = s->cos;  // [T, rd]: each row's angles (looked up in the tables)
  const float* sin = s->sin;
  if (s->pos != nullptr && s->rd > 0) {
    size_t most = 0;
    for (int i = 0; i < n; ++i) {
      const Layer& l = layers[i];
      most = std::max(most, size_t(T * (H + l.qkv.n + int64_t(l.nq) * l.hd + l.fc1.n)) * es);
    }
    float* c = reinterpret_cast<float*>(static_cast<char*>(work) + (most + 63) / 64 * 64);
    float* sn = c + T * s->rd;
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(c + t * s->rd, s->cos + s->pos[t] * s->rd, size_t(s->rd) * 4);
      std::memcpy(sn + t * s->rd, s->sin + s->pos[t] * s->rd, size_t(s->rd) * 4);
    }
    cos = c;
    sin = sn;
  }
  for (int i = 0; i < n; ++i) {
    const Layer& l = layers[i];
    const int64_t nqkv = l.qkv.n, ny = int64_t(l.nq) * l.hd;
    char* h = static_cast<char*>(work);  // [T, H]
    char* qkv = h + size_t(T * H) * es;  // [T, nqkv]
    char* y = qkv + size_t(T * nqkv) * es;  // [T, nq hd]
    char* a = y + size_t(T * ny) * es;  // [T, fc1's outputs]: work holds T (H + the rest)
    int rc = tpk_norm(x, l.n1w, l.n1b, h, T, H, l.n1eps, l.n1off, l.n1b != nullptr, s->dtype);
    rc = rc ? rc : tpk_linear(h, l.qkv.w, l.qkv.scale, l.qkv.bias, nullptr, qkv, T, H, nqkv,
                              s->dtype, l.qkv.wdtype, 0, s->threads);
    rc = rc ? rc : tpk_rope_write(qkv, T, nqkv, l.nq + l.nkv, l.nkv, l.hd, cos, sin,
                                  s->rd, s->write, s->ck[i], s->cv[i], s->dtype);
    rc = rc ? rc : s->attend(qkv, s->ck[i], s->cv[i], y, s->meta, l.kv_map, s->rows, l.nq,
                             l.nkv, l.hd, s->bs, s->dtype, s->attend_threads, nqkv);
    rc = rc ? rc : tpk_linear(y, l.out.w, l.out.scale, lead ? l.out.bias : nullptr, res, x,
                              T, ny, H, s->dtype, l.out.wdtype, 0, s->threads);
    rc = rc ? rc : reduced(s, x, T * H, 2 * i);
    rc = rc ? rc : tpk_norm(x, l.n2w, l.n2b, h, T, H, l.n2eps, l.n2off, l.n2b != nullptr, s->dtype);
    rc = rc ? rc : tpk_linear(h, l.fc1.w, l.fc1.scale, l.fc1.bias, nullptr, a, T, H, l.fc1.n,
                              s->dtype, l.fc1.wdtype, l.act == 0 ? 1 : 1 + l.act, s->threads);
    rc = rc ? rc : tpk_linear(a, l.fc2.w, l.fc2.scale, lead ? l.fc2.bias : nullptr, res, x, T,
                              l.fc2.k, H, s->dtype, l.fc2.wdtype, 0, s->threads);
    rc = rc ? rc : reduced(s, x, T * H, 2 * i + 1);
    if (rc) return rc;
  }
  if (e == nullptr || e->head.w == nullptr) return 0;
  int rc = head(x, work, *e, T, H, s->dtype, s->threads);
  if (rc || e->pick == nullptr) return rc;
  const float* every = e->best;  // at tp > 1 every rank's: the all-gather 2n + 1
  if (e->gather != nullptr) {
    s->spans[2 * (2 * n + 1)] = monotonic();
    rc = e->gather(s->rbase, s->rrank, e->best, e->every, size_t(T) * 3 * 4, s->rtimeout,
                   s->who);
    s->spans[2 * (2 * n + 1) + 1] = monotonic();
    if (rc) {
      s->failed = 2 * n + 1;
      return REDUCE_FAILED + rc;
    }
    every = e->every;
  }
  return tpk_pick(every, e->tp, T, e->pick);
}

}  // extern "C"
