// ---- sampling: logits -> the next token (sample/sampler.h) ----
#include <cmath>
#include <string>

#include "python/args.h"
#include "python/bind.h"
#include "sample/sampler.h"

namespace ktq::python {

namespace {

void check_param(const char* name, double x, bool ok, const char* allowed) {
  if (!ok) throw py::value_error(std::string(name) + " must be " + allowed + ", got " + std::to_string(x));
}

// SampleParams, checked once (ktquest/native/sample.py makes one a generation).
SampleParams make_params(int64_t top_k, float top_p, float min_p, float temperature, float repeat_penalty,
                         float frequency_penalty, float presence_penalty) {
  check_param("top_k", double(top_k), top_k >= 0, ">= 0 (0: off)");
  check_param("top_p", top_p, top_p > 0.f && top_p <= 1.f, "in (0, 1]");
  check_param("min_p", min_p, min_p >= 0.f && min_p <= 1.f, "in [0, 1]");
  check_param("temperature", temperature, std::isfinite(temperature) && temperature >= 0.f, "finite and >= 0");
  check_param("repeat_penalty", repeat_penalty, std::isfinite(repeat_penalty) && repeat_penalty > 0.f,
              "finite and > 0");
  check_param("frequency_penalty", frequency_penalty, std::isfinite(frequency_penalty), "finite");
  check_param("presence_penalty", presence_penalty, std::isfinite(presence_penalty), "finite");
  return SampleParams{top_k, top_p, min_p, temperature, repeat_penalty, frequency_penalty, presence_penalty};
}

// logits [V] fp32 (written for the call, restored) and recent [n] int32.
std::pair<py::array_t<float>, py::array_t<int32_t>> sample_args(const py::handle& logits_obj,
                                                                const py::handle& recent_obj) {
  auto logits = array_arg<float>(logits_obj, "logits", {-1});
  auto recent = array_arg<int32_t>(recent_obj, "recent", {-1});
  if (logits.shape(0) < 1 || logits.shape(0) > INT32_MAX)
    throw py::value_error("logits: expected 1 to 2^31-1 values, got " + std::to_string(logits.shape(0)));
  if (!logits.writeable()) throw py::value_error("logits: must be writeable (penalized in place for the call)");
  return {logits, recent};
}

}  // namespace

void bind_sample(py::module_& m) {
  py::class_<SampleParams>(m, "SampleParams", "The sampler's knobs, checked once (sample/sampler.h).")
      .def(py::init(&make_params), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("temperature"),
           py::arg("repeat_penalty"), py::arg("frequency_penalty"), py::arg("presence_penalty"));

  m.def("sample", [](const py::handle& logits_obj, const py::handle& recent_obj, const SampleParams& p, double u) {
    auto [logits, recent] = sample_args(logits_obj, recent_obj);
    if (!(u >= 0.0 && u < 1.0)) throw py::value_error("u must be in [0, 1), got " + std::to_string(u));
    float* lp = logits.mutable_data();
    const int32_t* rp = recent.data();
    const int64_t V = logits.shape(0), n_recent = recent.shape(0);
    py::gil_scoped_release nogil;
    return sample_token(lp, V, rp, n_recent, p, u);
  }, py::arg("logits"), py::arg("recent"), py::arg("params"), py::arg("u"),
     "The next token from logits [V] fp32 and the recent ids [n] int32: penalties, top-k, top-p, min-p, "
     "temperature (0: greedy), then the candidate where the cumulative probability passes u in [0, 1).");

  m.def("sample_distribution", [](const py::handle& logits_obj, const py::handle& recent_obj,
                                  const SampleParams& p) {
    auto [logits, recent] = sample_args(logits_obj, recent_obj);
    const int64_t V = logits.shape(0), room = sample_room(V, p);
    py::array_t<int32_t> ids(room);
    py::array_t<double> probs(room);
    int64_t n;
    {
      py::gil_scoped_release nogil;
      n = sample_distribution(logits.mutable_data(), V, recent.data(), recent.shape(0), p, ids.mutable_data(),
                              probs.mutable_data());
    }
    return py::make_tuple(ids[py::slice(0, n, 1)], probs[py::slice(0, n, 1)]);
  }, py::arg("logits"), py::arg("recent"), py::arg("params"),
     "What sample draws from: (ids int32 [n], probabilities float64 [n]), the best first.");
}

}  // namespace ktq::python
