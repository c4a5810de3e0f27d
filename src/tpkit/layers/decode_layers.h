// A stack of decode layers in one call (included once, by decode_ops.cpp, after the
// kernels it calls: tpk_norm, tpk_linear, tpk_rope_write).
#pragma once

namespace {

// ---- a stack of layers, one call (tp=1) ------------------------------------------------
// Every layer of a pre-norm dense model on a decode's T rows x [T, H] (in place):
//   h = norm1(x); qkv = h Wqkv^T + b; rotate q, k and write k, v into the layer's cache;
//   y = attention (the paged kernel, called through `attend`); x = x + (y Wout^T + b);
//   h = norm2(x); a = silu(h G^T) * (h U^T) (or act(h W1^T + b)); x = x + (a W2^T + b)
// each step the kernel of the same name above (the same sums as the layer's calls one by
// one from Python: the same bits), the buffers in `work`.
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
using Attend = int (*)(const void*, const void*, const void*, void*, const int64_t*,
                       const int32_t*, int, int, int, int, int, int, int, int64_t);
struct Step {
  int64_t T, H;
  int dtype, threads;
  const float* cos;
  const float* sin;
  int rd;
  const int64_t* write;
  void* const* ck;  // [layers]: each layer's cache
  void* const* cv;
  Attend attend;
  const int64_t* meta;
  int rows, bs, attend_threads;
};

template <class T>
__attribute__((optimize("fp-contract=off")))
void activate(T* a, int64_t n, int act) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = widen(a[i]);
    float o;
    if (act == 1)
      o = 0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    else if (act == 2)
      o = 0.5f * v * (1.0f + std::erf(v * 0.7071067811865476f));
    else
      o = v > 0.0f ? v : 0.0f;
    narrow(o, a + i);
  }
}

}  // namespace

extern "C" {

// x [T, H] in place through n layers; work: T * (H + max over the layers of qkv.n +
// nq hd + fc1.n) elements of x's dtype. 0: done; else the first failing kernel's code.
int tpk_layers(void* x, const Layer* layers, int n, const Step* s, void* work) {
  const int64_t T = s->T, H = s->H;
  const size_t es = s->dtype == 0 ? 4 : 2;
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
    rc = rc ? rc : tpk_rope_write(qkv, T, nqkv, l.nq + l.nkv, l.nkv, l.hd, s->cos, s->sin,
                                  s->rd, s->write, s->ck[i], s->cv[i], s->dtype);
    rc = rc ? rc : s->attend(qkv, s->ck[i], s->cv[i], y, s->meta, l.kv_map, s->rows, l.nq,
                             l.nkv, l.hd, s->bs, s->dtype, s->attend_threads, nqkv);
    rc = rc ? rc : tpk_linear(y, l.out.w, l.out.scale, l.out.bias, x, x, T, ny, H, s->dtype,
                              l.out.wdtype, 0, s->threads);
    rc = rc ? rc : tpk_norm(x, l.n2w, l.n2b, h, T, H, l.n2eps, l.n2off, l.n2b != nullptr, s->dtype);
    rc = rc ? rc : tpk_linear(h, l.fc1.w, l.fc1.scale, l.fc1.bias, nullptr, a, T, H, l.fc1.n,
                              s->dtype, l.fc1.wdtype, l.act == 0, s->threads);
    if (rc) return rc;
    if (l.act != 0) {
      if (s->dtype == 0)
        activate(reinterpret_cast<float*>(a), T * l.fc1.n, l.act);
      else
        activate(reinterpret_cast<uint16_t*>(a), T * l.fc1.n, l.act);
    }
    rc = tpk_linear(a, l.fc2.w, l.fc2.scale, l.fc2.bias, x, x, T, l.fc2.k, H, s->dtype,
                    l.fc2.wdtype, 0, s->threads);
    if (rc) return rc;
  }
  return 0;
}

}  // extern "C"
