// python/csrc/bindings.cpp — the Python module mixattn._C: what is not an operator (the
// operators are registered in ops.cpp and caches.cpp and called as torch.ops.mixattn.*): the
// library's version, the kept records' release, the handles' Python-side views (an OVQ state's
// sizes, a prepared mixture), the decoding caches' methods and the decode benchmark's timings.
#include "bindings.hpp"

// torch/python.h (pybind11 with the tensor type casters) and ATen instead of torch/extension.h,
// which adds the whole C++ frontend (nn, optim, data) and doubles the compile time.
#include <torch/python.h>

#include <tuple>

namespace mixattn_torch {

void define_caches(pybind11::module_& m);  // caches.cpp

namespace {

/// The heads' mixtures reduced once (kernels.hpp, gma_prepare) for the state forward: mean,
/// var_raw (H, K, r), prior_logit (H, K) of one floating type; a handle.
at::Tensor gma_prepare_py(at::Tensor mean, at::Tensor var_raw, at::Tensor prior_logit,
                          double var_floor, bool check_finite) {
  const std::string fn = "mixattn.gma_attention";
  const at::Tensor q = checked(mean, fn, "mean", 3, mean).unsqueeze(0);  // (1, H, K, r)
  const GmaArgs a =
      gma_args(fn, q, q, q, mean, var_raw, prior_logit, false, 0, var_floor, check_finite);
  SavedPtr heads = dispatch(a.q, [&](auto t) {
    using T = decltype(t);
    return gma_prepare<T>(a.shape, a.config, gma_inputs<T>(a));
  });
  return make_handle("gma-prepared/" + dtype_name(a.q), std::move(heads));
}

/// Performer's directions for `heads` heads (kernels.hpp, performer_draw): (heads, m, r) float64,
/// head h drawn by performer::Features<double>::random(m, r, seed + h, draw).
at::Tensor performer_features_py(int64_t heads, int64_t m, int64_t r, uint64_t seed,
                                 const std::string& draw) {
  const std::string fn = "mixattn.performer_features";
  if (heads < 0) fail(fn, "heads is " + std::to_string(heads) + "; it must be >= 0");
  if (m < 1) fail(fn, "features is " + std::to_string(m) + "; it must be >= 1");
  if (r < 1) fail(fn, "key_dim is " + std::to_string(r) + "; it must be >= 1");
  if (draw != "orthogonal" && draw != "iid")
    fail(fn, "draw is '" + draw + "'; it must be 'orthogonal' or 'iid'");
  at::Tensor w = at::empty({heads, m, r}, at::TensorOptions().dtype(at::kDouble));
  performer_draw(heads, m, r, seed, draw == "orthogonal", w.data_ptr<double>());
  return w;
}

/// An OVQ state handle's (kind, streams, heads, tokens seen per pair).
pybind11::tuple ovq_state_info(const at::Tensor& state) {
  std::shared_ptr<const OvqStateBox> keep;
  const OvqStateBox* b = ovq_state_named_by(state, keep);
  if (b == nullptr)
    throw std::invalid_argument("mixattn.OvqState: not the state an ovq_attention call returned");
  return pybind11::make_tuple(b->kind, b->shape.batch, b->shape.heads, b->states->tokens_seen());
}

/// The library's own one-token calls, timed in C++ (kernels.hpp, gma_decode_seconds): q, k
/// (H, T, r), v (H, T, d_v), mean, var_raw (H, K, r), prior_logit (H, K), float32.
std::vector<double> gma_decode_seconds_py(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor mean,
                                          at::Tensor var_raw, at::Tensor prior_logit,
                                          int64_t prefill, bool all_heads_per_call) {
  const std::string fn = "mixattn._C.testing.gma_decode_seconds";
  const GmaArgs a = gma_args(fn, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mean, var_raw,
                             prior_logit, true, 1e-6, 1e-4, true);
  const Shape& s = a.shape;
  if (a.q.scalar_type() != at::kFloat) fail(fn, "q must be float32");
  if (prefill < 1 || prefill >= s.queries)
    fail(fn, "prefill is " + std::to_string(prefill) + "; it must be in [1, tokens)");
  return gma_decode_seconds(a.q.data_ptr<float>(), a.k.data_ptr<float>(), a.v.data_ptr<float>(),
                            s.heads, s.queries, s.key_dim, s.value_dim, a.mean.data_ptr<float>(),
                            a.var_raw.data_ptr<float>(), a.prior_logit.data_ptr<float>(),
                            a.config.components, prefill, all_heads_per_call);
}

/// The same for OVQ (ovq_decode_seconds): q, k (H, T, r), v (H, T, d_v) float32, a scalar beta.
std::vector<double> ovq_decode_seconds_py(at::Tensor q, at::Tensor k, at::Tensor v, double beta,
                                          const OvqConfig& c, int64_t prefill,
                                          bool all_heads_per_call) {
  const std::string fn = "mixattn._C.testing.ovq_decode_seconds";
  at::Tensor q4 = q.unsqueeze(0), k4 = k.unsqueeze(0), v4 = v.unsqueeze(0);
  const Shape s = attention_shape(fn, q4, k4, v4);
  if (q4.scalar_type() != at::kFloat) fail(fn, "q must be float32");
  if (prefill < 1 || prefill >= s.queries)
    fail(fn, "prefill is " + std::to_string(prefill) + "; it must be in [1, tokens)");
  return ovq_decode_seconds(q4.data_ptr<float>(), k4.data_ptr<float>(), v4.data_ptr<float>(),
                            s.heads, s.queries, s.key_dim, s.value_dim, static_cast<float>(beta), c,
                            prefill, all_heads_per_call);
}

}  // namespace
}  // namespace mixattn_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace mt = mixattn_torch;
  namespace py = pybind11;
  m.doc() = "mixattn's kernels on PyTorch tensors; use the mixattn package, not this module";
  py::class_<mt::OvqConfig>(m, "OvqConfig")
      .def(py::init([](int64_t block, int64_t max_centroids, const std::string& growth,
                       double growth_alpha, const std::string& seeding,
                       const std::string& assignment, bool count_bias, bool grad_through_dictionary,
                       double norm_eps, bool check_finite) {
             return mt::ovq_config("mixattn._C.OvqConfig", block, max_centroids, growth,
                                   growth_alpha, seeding, assignment, count_bias,
                                   grad_through_dictionary, norm_eps, check_finite);
           }),
           py::arg("block"), py::arg("max_centroids"), py::arg("growth"), py::arg("growth_alpha"),
           py::arg("seeding"), py::arg("assignment"), py::arg("count_bias"),
           py::arg("grad_through_dictionary"), py::arg("norm_eps"), py::arg("check_finite"))
      .def("__repr__",
           [](const mt::OvqConfig& c) { return "OvqConfig(" + mt::state_options(c) + ")"; });
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("gma_prepare", &mt::gma_prepare_py, nogil);
  m.def("handle_kind", [](const at::Tensor& t) -> std::optional<std::string> {
    const mt::Held* held = mt::held_by(t);
    if (held == nullptr) return std::nullopt;
    return held->kind;
  });
  m.def("handle_holds_record", [](const at::Tensor& t) {
    const mt::Held* held = mt::held_by(t);
    return held != nullptr && static_cast<bool>(held->object);
  });
  m.def("prepared_stale", [](const at::Tensor& t) {
    const mt::Held* held = mt::held_by(t);
    return held != nullptr && held->stale.load();
  });
  m.def("ovq_state_info", &mt::ovq_state_info);
  m.def("performer_features", &mt::performer_features_py, py::arg("heads"), py::arg("features"),
        py::arg("key_dim"), py::arg("seed"), py::arg("draw"), nogil);
  m.def("library_version", &mt::library_version);
  m.def("release_kept_records", &mt::release_kept_records, nogil,
        "Frees the records of finished calls kept for reuse by the next forwards (see "
        "mixattn.release_memory).");
  mt::define_caches(m);
  auto testing = m.def_submodule("testing",
                                 "For the decode benchmark: the library's own one-token "
                                 "calls on one head, timed in C++.");
  testing.def("gma_decode_seconds", &mt::gma_decode_seconds_py, py::arg("q"), py::arg("k"),
              py::arg("v"), py::arg("mean"), py::arg("var_raw"), py::arg("prior_logit"),
              py::arg("prefill"), py::arg("all_heads_per_call"), nogil);
  testing.def("ovq_decode_seconds", &mt::ovq_decode_seconds_py, py::arg("q"), py::arg("k"),
              py::arg("v"), py::arg("beta"), py::arg("config"), py::arg("prefill"),
              py::arg("all_heads_per_call"), nogil);
}
