#include "common/finite.h"

#include <stdexcept>
#include <string>

namespace ktq {

void check_finite_q(const float* q, int64_t H, int D) {
  const int64_t i = first_non_finite(q, H * D);
  if (i >= 0)
    throw std::invalid_argument("q contains a non-finite value at head " + std::to_string(i / D) + ", dim " +
                                std::to_string(i % D));
}

void check_finite(float x, const char* name) {
  if (first_non_finite(&x, 1) >= 0)
    throw std::invalid_argument(std::string(name) + "=" + std::to_string(x) + " is not finite");
}

}  // namespace ktq
