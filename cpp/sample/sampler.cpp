// sample_token (sampler.h) and the scalar twin of top_candidates.
#include "sample/sampler.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/cpu_features.h"
#include "sample/heap.h"

namespace ktq {

namespace scalar {

int64_t top_candidates(const float* logits, int64_t n, int64_t k, Candidate* out) {
  k = std::clamp<int64_t>(k, 0, n);
  if (k == 0) return 0;
  CandidateHeap heap(logits, k, out);
  for (int64_t i = k; i < n; ++i) heap.offer(logits[i], int32_t(i));
  return heap.sorted();
}

}  // namespace scalar

namespace {

// The penalties, applied in place to the logits of the distinct recent ids, and undone when it goes out of
// scope (the caller's logits are read-only to it).
class Penalties {
 public:
  Penalties(float* logits, int64_t V, const int32_t* recent, int64_t n, const SampleParams& p) : logits_(logits) {
    if (n == 0 || (p.repeat_penalty == 1.f && p.frequency_penalty == 0.f && p.presence_penalty == 0.f)) return;
    std::vector<int32_t> ids;
    ids.reserve(size_t(n));
    for (int64_t i = 0; i < n; ++i)
      if (recent[i] >= 0 && recent[i] < V) ids.push_back(recent[i]);
    std::sort(ids.begin(), ids.end());
    saved_.reserve(ids.size());
    for (size_t i = 0; i < ids.size();) {
      size_t j = i;
      while (j < ids.size() && ids[j] == ids[i]) ++j;
      const int32_t id = ids[i];
      const float count = float(j - i);
      float x = logits[id];
      saved_.emplace_back(id, x);
      // repeat: a seen token loses ground whatever its sign (llama.cpp); frequency and presence: OpenAI's.
      x = x > 0.f ? x / p.repeat_penalty : x * p.repeat_penalty;
      logits[id] = x - count * p.frequency_penalty - p.presence_penalty;
      i = j;
    }
  }
  ~Penalties() {
    for (const auto& [id, x] : saved_) logits_[id] = x;
  }
  Penalties(const Penalties&) = delete;
  Penalties& operator=(const Penalties&) = delete;

 private:
  float* logits_;
  std::vector<std::pair<int32_t, float>> saved_;
};

}  // namespace

int64_t sample_room(int64_t V, const SampleParams& p) {
  if (p.temperature == 0.f) return 1;
  return p.top_k > 0 && p.top_k < V ? p.top_k : V;
}

int64_t sample_distribution(float* logits, int64_t V, const int32_t* recent, int64_t n_recent,
                            const SampleParams& p, int32_t* ids, double* probs) {
  Penalties penalties(logits, V, recent, n_recent, p);
  const int64_t k = sample_room(V, p);
  std::vector<Candidate> cand(static_cast<size_t>(k));  // [k], best first
  const int64_t n = use_avx2() ? avx2::top_candidates(logits, V, k, cand.data())
                               : scalar::top_candidates(logits, V, k, cand.data());
  const double x0 = cand[0].logit;
  if (!std::isfinite(x0))
    throw std::invalid_argument("sample: the largest logit is not finite (" + std::to_string(x0) + ")");

  // ---- top-p, then min-p: on probabilities at temperature 1 (the max subtracted before exp) ----
  double* w = probs;  // [n] weights, then the probabilities
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += w[i] = std::exp(double(cand[i].logit) - x0);
  int64_t keep = n;
  if (p.top_p < 1.f) {  // the smallest prefix whose mass reaches top_p (the mass above each one is below it)
    double before = 0.0;
    int64_t m = 0;
    while (m < n && before < double(p.top_p) * total) before += w[m++];
    keep = std::max<int64_t>(1, m);
  }
  if (p.min_p > 0.f) {  // at least min_p times the best one's probability (w[0] = 1)
    int64_t m = 0;
    while (m < keep && w[m] >= double(p.min_p)) ++m;
    keep = std::max<int64_t>(1, m);
  }

  // ---- temperature: the kept candidates' weights, normalized ----
  const double T = p.temperature == 0.f ? 1.0 : double(p.temperature);  // greedy: keep = 1
  total = 0.0;
  for (int64_t i = 0; i < keep; ++i) total += w[i] = std::exp((double(cand[i].logit) - x0) / T);
  for (int64_t i = 0; i < keep; ++i) {
    w[i] /= total;
    ids[i] = cand[i].id;
  }
  return keep;
}

int32_t sample_token(float* logits, int64_t V, const int32_t* recent, int64_t n_recent, const SampleParams& p,
                     double u) {
  const int64_t room = sample_room(V, p);
  std::vector<int32_t> ids(static_cast<size_t>(room));
  std::vector<double> probs(static_cast<size_t>(room));
  const int64_t n = sample_distribution(logits, V, recent, n_recent, p, ids.data(), probs.data());
  double cdf = 0.0;
  for (int64_t i = 0; i < n - 1; ++i) {
    cdf += probs[i];
    if (cdf > u) return ids[i];
  }
  return ids[n - 1];
}

}  // namespace ktq
