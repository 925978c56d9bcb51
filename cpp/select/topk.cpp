// Scalar twin of the top-k kernel (topk.h).
#include "select/topk.h"

#include <algorithm>

namespace ktq::scalar {

int64_t top_k(const float* v, int64_t n, int64_t k, const int32_t* ids, int32_t* out, int32_t* keys) {
  k = std::clamp<int64_t>(k, 0, n);
  if (k == 0) return 0;
  for (int64_t i = 0; i < n; ++i) keys[i] = topk_order_key(v[i]);
  auto count_ge = [&](int32_t t) {
    int32_t c = 0;
    for (int64_t i = 0; i < n; ++i) c += keys[i] >= t;
    return int64_t(c);
  };
  const int32_t kth = topk_kth_key(k, count_ge);
  return topk_keep(keys, n, k, kth, k - (kth == INT32_MAX ? 0 : count_ge(kth + 1)), ids, out);
}

}  // namespace ktq::scalar
