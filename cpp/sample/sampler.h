// Sampling on raw pointers: logits [V] -> one token id, in llama.cpp's order so the knobs mean what its users
// expect:
//
//     penalties (repeat, frequency, presence over the recent ids) -> top-k -> top-p -> min-p -> temperature -> draw
//
// ktquest/native/sample.py calls it once a token; its numpy twin (the reference) is in tests/test_sampling.py.
// With top-k on, only its scan runs over the whole vocabulary, so only it has an AVX2 twin (sampler_avx2.cpp);
// every other step works on the k candidates. With top-k off, a pass over every id sums the mass (and bins it
// for top-p), and only the ids a cut can keep are ranked; that total is summed in id order, not best first,
// so a prefix that lands exactly on top_p of it may keep one id more or less than a ranked sum would.
#pragma once

#include <cstdint>

namespace ktq {

struct SampleParams {
  int64_t top_k = 40;       // 0 or >= V: off (every id is a candidate)
  float top_p = 1.f;        // (0, 1]; 1: off
  float min_p = 0.f;        // [0, 1]; 0: off
  float temperature = 0.f;  // 0: greedy, the argmax after the penalties
  float repeat_penalty = 1.f, frequency_penalty = 0.f, presence_penalty = 0.f;
};

// A candidate: a logit and its id. Candidates are ranked by logit, then by id (the lower first), so ties are
// broken the same way on every path and at every thread count.
struct Candidate {
  float logit;
  int32_t id;
};
inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

// ---- contract (both twins) ----
//
// top_candidates: the min(k, n) best of logits[0, n) by ranks_before, best first, into out (room for k).
// NaN ranks as -inf. A single pass: a heap of the k best so far; an id enters only when its logit beats the
// heap's worst (ids come in increasing order, so an equal logit never enters).
namespace scalar {
int64_t top_candidates(const float* logits, int64_t n, int64_t k, Candidate* out);
}  // namespace scalar
namespace avx2 {
int64_t top_candidates(const float* logits, int64_t n, int64_t k, Candidate* out);
}  // namespace avx2

// sample_distribution: what sample_token draws from. logits [V] (V >= 1) are penalized in place for the call
// and restored before it returns; recent [n_recent]: the ids to penalize (repeats count, ids outside [0, V)
// are ignored). Writes the candidates left by top-k, top-p and min-p, best first, to ids and their
// probabilities at the temperature to probs (they sum to 1; greedy: the argmax alone, probability 1); both
// need room for min(top_k, V) (V when top_k is off). Returns how many. Throws std::invalid_argument when the
// best logit is not finite.
int64_t sample_distribution(float* logits, int64_t V, const int32_t* recent, int64_t n_recent,
                            const SampleParams& p, int32_t* ids, double* probs);

// sample_token: the sampled id: the first candidate of sample_distribution whose cumulative probability passes
// u, a uniform draw in [0, 1) from the caller's seeded stream (so the result does not depend on threads).
// With top-k off and neither top-p nor min-p over a vocabulary of more than 4096 ids, the same distribution is
// walked in id order instead (nothing ranked: a seed's draws differ from the ranked walk's). With a cut and
// top-k off, sample_distribution ranks only the ids the cut can keep.
int32_t sample_token(float* logits, int64_t V, const int32_t* recent, int64_t n_recent, const SampleParams& p,
                     double u);

// The room sample_distribution needs: min(top_k, V), or V when top_k is off; 1 when greedy.
int64_t sample_room(int64_t V, const SampleParams& p);

}  // namespace ktq
