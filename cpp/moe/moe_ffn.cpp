// A decode token's mixture-of-experts FFN (moe_ffn.h).
#include "moe/moe_ffn.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace ktq {

namespace {

std::string shape(const QuantMatrix& m) { return "[" + std::to_string(m.out) + ", " + std::to_string(m.in) + "]"; }

// h[:ffn] = silu(gate) * up for h = [gate | up] of 2 * ffn values.
void swiglu(float* h, int64_t ffn) {
  for (int64_t i = 0; i < ffn; ++i) {
    const float g = h[i];
    h[i] = g / (1.f + std::exp(-g)) * h[ffn + i];
  }
}

}  // namespace

void check_moe(const MoeWeights& w, int64_t dim) {
  const int64_t E = int64_t(w.gate_up.size());
  if (E < 1 || int64_t(w.down.size()) != E)
    throw std::invalid_argument("experts: " + std::to_string(E) + " gate | up and " + std::to_string(w.down.size()) +
                                " down matrices; expected one of each per expert (at least one)");
  if (w.router.out != E || w.router.in != dim)
    throw std::invalid_argument("router: expected [" + std::to_string(E) + ", " + std::to_string(dim) + "] (experts, dim), got " +
                                shape(w.router));
  if (w.n_used < 1 || w.n_used > E)
    throw std::invalid_argument("n_used=" + std::to_string(w.n_used) + ": expected 1.." + std::to_string(E));
  const int64_t two_ffn = w.gate_up[0].out;
  if (two_ffn < 2 || two_ffn % 2 != 0)
    throw std::invalid_argument("experts_gate_up[0]: expected 2 * ffn rows (gate | up), got " + shape(w.gate_up[0]));
  for (int64_t e = 0; e < E; ++e) {
    const QuantMatrix &gu = w.gate_up[size_t(e)], &d = w.down[size_t(e)];
    if (gu.out != two_ffn || gu.in != dim)
      throw std::invalid_argument("experts_gate_up[" + std::to_string(e) + "]: expected [" + std::to_string(two_ffn) +
                                  ", " + std::to_string(dim) + "], got " + shape(gu));
    if (d.out != dim || d.in != two_ffn / 2)
      throw std::invalid_argument("experts_down[" + std::to_string(e) + "]: expected [" + std::to_string(dim) + ", " +
                                  std::to_string(two_ffn / 2) + "], got " + shape(d));
  }
  if (w.shared_gate_up.out == 0 && w.shared_down.out == 0 && w.shared_gate == nullptr) return;
  const QuantMatrix &sgu = w.shared_gate_up, &sd = w.shared_down;
  if (w.shared_gate == nullptr || sgu.out < 2 || sgu.out % 2 != 0 || sgu.in != dim || sd.out != dim ||
      sd.in != sgu.out / 2)
    throw std::invalid_argument("shared expert: expected gate | up [2 * ffn_s, " + std::to_string(dim) + "], down [" +
                                std::to_string(dim) + ", ffn_s] and its gate [dim], got " + shape(sgu) + ", " +
                                shape(sd) + (w.shared_gate ? "" : " and no gate"));
}

void moe_route(const float* logits, int E, int k, bool norm, int32_t* ids, float* weights) {
  // softmax in fp32 with the max subtracted (no overflow in exp); the sum over every expert, in order
  thread_local std::vector<float> p;  // [E]
  p.resize(size_t(E));
  float mx = logits[0];
  for (int e = 1; e < E; ++e) mx = std::max(mx, logits[e]);
  float sum = 0.f;
  for (int e = 0; e < E; ++e) sum += p[size_t(e)] = std::exp(logits[e] - mx);
  for (int e = 0; e < E; ++e) p[size_t(e)] /= sum;
  // The k largest by repeated selection (k <= 8 of E <= 512 in the released models): only a strictly larger
  // probability replaces the best, so equal ones go to the lower id, as ktquest's route() (a stable sort) does.
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= ids[i] == e;
      if (!taken && (best < 0 || p[size_t(e)] > p[size_t(best)])) best = e;
    }
    ids[j] = best;
    weights[j] = p[size_t(best)];
  }
  if (norm) {
    float s = 0.f;
    for (int j = 0; j < k; ++j) s += weights[j];
    for (int j = 0; j < k; ++j) weights[j] /= s;
  }
}

MoeFfn::MoeFfn(const MoeWeights& w) : w_(w) {
  check_moe(w_, w_.router.in);
  const int k = w_.n_used;
  const int64_t dim = w_.router.in, two_ffn = w_.gate_up[0].out;
  logits_.resize(size_t(w_.router.out));
  wts_.resize(size_t(k));
  ids_.resize(size_t(k));
  h_.resize(size_t(k * two_ffn + w_.shared_gate_up.out));
  out_.resize(size_t((k + 1) * dim));
  jobs_.resize(size_t(k + 1));
}

void MoeFfn::run(const float* xn, float* y, int n_threads, int32_t* ids, float* weights) {
  const int k = w_.n_used, E = int(w_.router.out);
  const int64_t dim = w_.router.in, two_ffn = w_.gate_up[0].out, ffn = two_ffn / 2;
  const bool shared = w_.shared_gate_up.out > 0;
  gemv_matrix(w_.router, xn, 1, logits_.data(), n_threads);
  moe_route(logits_.data(), E, k, w_.norm_topk, ids_.data(), wts_.data());
  // h: [k, 2 * ffn] the chosen experts' gate | up, then the shared expert's [2 * ffn_s]; out: [k (+1), dim]
  float* hs = h_.data() + k * two_ffn;
  GemvJob* jobs = jobs_.data();  // [k + 1]: the chosen experts', and the shared expert's
  int n = 0;
  for (int j = 0; j < k; ++j) jobs[n++] = {&w_.gate_up[size_t(ids_[j])], xn, h_.data() + j * two_ffn};
  if (shared) jobs[n++] = {&w_.shared_gate_up, xn, hs};
  gemv_jobs(jobs, n, n_threads);
  for (int j = 0; j < k; ++j) swiglu(h_.data() + j * two_ffn, ffn);
  if (shared) swiglu(hs, w_.shared_gate_up.out / 2);
  n = 0;
  for (int j = 0; j < k; ++j) jobs[n++] = {&w_.down[size_t(ids_[j])], h_.data() + j * two_ffn, out_.data() + j * dim};
  if (shared) jobs[n++] = {&w_.shared_down, hs, out_.data() + k * dim};
  gemv_jobs(jobs, n, n_threads);
  // the weighted sum, in routing order
  for (int64_t i = 0; i < dim; ++i) {
    float s = 0.f;
    for (int j = 0; j < k; ++j) s += wts_[size_t(j)] * out_[size_t(j * dim + i)];
    y[i] = s;
  }
  if (shared) {
    double g = 0.0;  // sigmoid(shared_gate . xn)
    for (int64_t i = 0; i < dim; ++i) g += double(w_.shared_gate[i]) * xn[i];
    const float sg = float(1.0 / (1.0 + std::exp(-g)));
    for (int64_t i = 0; i < dim; ++i) y[i] += sg * out_[size_t(k * dim + i)];
  }
  if (ids != nullptr)
    for (int j = 0; j < k; ++j) ids[j] = ids_[size_t(j)], weights[j] = wts_[size_t(j)];
}

}  // namespace ktq
