// sample_token (sampler.h) and the scalar twin of top_candidates.
#include "sample/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
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

namespace {

// Past this many ids, a draw with top-k off ranks only what its cuts can keep (reachable) instead of the
// whole vocabulary (19.5 ms a token at 151,936 ids through the candidates' heap).
constexpr int64_t kRankAll = 4096;

// exp((x - x0) / T); NaN: no mass
double weight(float x, double x0, double T = 1.0) { return x == x ? std::exp((double(x) - x0) / T) : 0.0; }

// The largest logit (NaN skipped; -inf where every one is NaN or -inf).
double best_logit(const float* logits, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i)
    if (logits[i] > best) best = logits[i];
  return best;
}

// top-k off, top-p or min-p on: the candidates those cuts can keep, best first, into cand; total: the
// mass of every id at temperature 1 (what top-p is measured against); returns the best logit. One pass sums
// the mass by how far below the best each logit lies (kBins bins a nat, kNats nats, the rest in the last
// bin); top-p's prefix ends in the first bin where the mass from the top reaches top_p of the total, so only
// the ids down to the bin after it can be kept (one bin of margin for the sums' order), and with min-p only
// those within log(min_p) of the best. Those are ranked.
double reachable(const float* logits, int64_t V, const SampleParams& p, std::vector<Candidate>& cand,
                 double& total) {
  constexpr int kBins = 8, kNats = 64, kAll = kBins * kNats;
  const double x0 = best_logit(logits, V);
  if (!std::isfinite(x0)) return x0;
  auto bin = [&](float x) { return int(std::min<double>(kAll - 1, (x0 - double(x)) * kBins)); };
  std::vector<double> mass(kAll, 0.0);
  total = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    const double w = weight(logits[i], x0);
    total += w;
    if (w > 0.0) mass[size_t(bin(logits[i]))] += w;
  }
  int last = kAll - 1;  // the last bin a kept id can lie in
  if (p.top_p < 1.f) {
    double from_top = 0.0;
    for (int b = 0; b < kAll; ++b) {
      from_top += mass[size_t(b)];
      if (from_top >= double(p.top_p) * total) {
        last = std::min(kAll - 1, b + 1);
        break;
      }
    }
  }
  for (;;) {
    cand.clear();
    bool left_out = false;  // an id with mass that only the bins left out (min-p would have kept it)
    for (int64_t i = 0; i < V; ++i) {
      const float x = logits[i];
      if (!(x == x) || (p.min_p > 0.f && weight(x, x0) < double(p.min_p))) continue;
      if (bin(x) <= last) cand.push_back({x, int32_t(i)});
      else left_out = left_out || weight(x, x0) > 0.0;
    }
    std::sort(cand.begin(), cand.end(), ranks_before);
    // The prefix must close among them. It may not where the sums' order moved the mass across an empty bin
    // after the margin: then every bin is taken (rare: the sums differ in their last bits).
    double before = 0.0;
    for (size_t i = 0; i < cand.size() && before < double(p.top_p) * total; ++i) before += weight(cand[i].logit, x0);
    if (!left_out || p.top_p >= 1.f || before >= double(p.top_p) * total) return x0;
    last = kAll - 1;
  }
}

}  // namespace

int64_t sample_distribution(float* logits, int64_t V, const int32_t* recent, int64_t n_recent,
                            const SampleParams& p, int32_t* ids, double* probs) {
  Penalties penalties(logits, V, recent, n_recent, p);
  const int64_t k = sample_room(V, p);
  std::vector<Candidate> cand;  // best first
  double total = 0.0, x0;
  int64_t n;
  if (k == V && V > kRankAll && p.temperature != 0.f && (p.top_p < 1.f || p.min_p > 0.f)) {
    x0 = reachable(logits, V, p, cand, total);
    n = int64_t(cand.size());
  } else {
    cand.resize(static_cast<size_t>(k));
    n = use_avx2() ? avx2::top_candidates(logits, V, k, cand.data())
                   : scalar::top_candidates(logits, V, k, cand.data());
    x0 = cand[0].logit;
    for (int64_t i = 0; i < n && std::isfinite(x0); ++i) total += std::exp(double(cand[i].logit) - x0);
  }
  if (!std::isfinite(x0))
    throw std::invalid_argument("sample: the largest logit is not finite (" + std::to_string(x0) + ")");

  // ---- top-p, then min-p: on probabilities at temperature 1 (the max subtracted before exp) ----
  double* w = probs;  // [n] weights, then the probabilities
  for (int64_t i = 0; i < n; ++i) w[i] = std::exp(double(cand[i].logit) - x0);
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
  if (room == V && V > kRankAll && p.temperature != 0.f && p.top_p >= 1.f && p.min_p <= 0.f) {
    // No cut: the tempered softmax over every id, drawn in id order (no ranking at all).
    Penalties penalties(logits, V, recent, n_recent, p);
    const double best = best_logit(logits, V);
    if (!std::isfinite(best))
      throw std::invalid_argument("sample: the largest logit is not finite (" + std::to_string(best) + ")");
    std::vector<double> w(static_cast<size_t>(V));
    double total = 0.0;
    for (int64_t i = 0; i < V; ++i) total += w[size_t(i)] = weight(logits[i], best, double(p.temperature));
    double cdf = 0.0;
    int32_t last = 0;
    for (int64_t i = 0; i < V; ++i) {
      if (w[size_t(i)] == 0.0) continue;
      last = int32_t(i);
      cdf += w[size_t(i)] / total;
      if (cdf > u) return last;
    }
    return last;
  }
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
