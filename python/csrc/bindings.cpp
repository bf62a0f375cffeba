// python/csrc/bindings.cpp — the extension module mixattn._C: argument checks, tensor
// allocation and dtype dispatch in front of the kernels (kernels.hpp). The autograd wiring is
// in Python (mixattn/functional.py, torch.autograd.Function); these functions see contiguous
// CPU tensors of one floating type and return plain tensors.
//
// Errors: bad shapes, dtypes or devices raise ValueError naming the Python function and the
// argument (std::invalid_argument); the library's own checks (non-finite inputs: ValueError
// from std::domain_error) pass through.
#include "bindings.hpp"

#include <tuple>

namespace mixattn_torch {
namespace {

// --- GMA ---------------------------------------------------------------------------------------

std::tuple<at::Tensor, SavedBox> gma_forward_py(at::Tensor q, at::Tensor k, at::Tensor v,
                                                at::Tensor mean, at::Tensor var_raw,
                                                at::Tensor prior_logit, bool causal, double eps,
                                                double var_floor, bool check_finite, bool save) {
  const GmaArgs a = gma_args("mixattn.gma_attention", q, k, v, mean, var_raw, prior_logit, causal,
                             eps, var_floor, check_finite);
  const Shape& s = a.shape;
  at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, a.q.options());
  SavedPtr rec = dispatch(a.q, [&](auto t) {
    using T = decltype(t);
    return gma_forward<T>(s, a.config, gma_inputs<T>(a), out.data_ptr<T>(), nullptr, nullptr,
                          nullptr, save);
  });
  return {out, box("gma", a.q, std::move(rec))};
}

std::vector<at::Tensor> gma_backward_py(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor mean,
                                        at::Tensor var_raw, at::Tensor prior_logit,
                                        at::Tensor grad_out, const SavedBox& saved, bool causal,
                                        double eps, double var_floor, bool check_finite,
                                        const std::vector<int64_t>& offsets) {
  const std::string fn = "mixattn.gma_attention (backward)";
  const GmaArgs a =
      gma_args(fn, q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor, check_finite);
  const Shape s = sequences_shape(fn, a.shape, offsets);  // a cache's packed call
  grad_out = checked_grad_out(fn, grad_out, s, a.q);
  const SavedPtr& rec = unbox(saved, "gma", a.q, fn);
  auto dq = at::empty_like(a.q), dk = at::empty_like(a.k), dv = at::empty_like(a.v);
  auto dmean = at::empty_like(a.mean), dvar = at::empty_like(a.var_raw);
  auto dprior = at::empty_like(a.prior_logit);
  dispatch(a.q, [&](auto t) {
    using T = decltype(t);
    gma_backward<T>(s, a.config, gma_inputs<T>(a), grad_out.data_ptr<T>(), rec, dq.data_ptr<T>(),
                    dk.data_ptr<T>(), dv.data_ptr<T>(), dmean.data_ptr<T>(), dvar.data_ptr<T>(),
                    dprior.data_ptr<T>());
  });
  return {dq, dk, dv, dmean, dvar, dprior};
}

/// The heads' mixtures reduced once (kernels.hpp, gma_prepare) for the state forward: mean,
/// var_raw (H, K, r), prior_logit (H, K) of one floating type.
SavedBox gma_prepare_py(at::Tensor mean, at::Tensor var_raw, at::Tensor prior_logit,
                        double var_floor, bool check_finite) {
  const std::string fn = "mixattn.gma_attention";
  const at::Tensor q = checked(mean, fn, "mean", 3, mean).unsqueeze(0);  // (1, H, K, r)
  const GmaArgs a =
      gma_args(fn, q, q, q, mean, var_raw, prior_logit, false, 0, var_floor, check_finite);
  SavedPtr heads = dispatch(a.q, [&](auto t) {
    using T = decltype(t);
    return gma_prepare<T>(a.shape, a.config, gma_inputs<T>(a));
  });
  return box("gma-prepared", a.q, std::move(heads));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, SavedBox, bool> gma_forward_state_py(
    at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor mean, at::Tensor var_raw,
    at::Tensor prior_logit, at::Tensor S0, at::Tensor z0, double eps, double var_floor,
    bool check_finite, const SavedBox* prepared, bool save, const std::vector<int64_t>& offsets) {
  const std::string fn = "mixattn.gma_attention";
  const GmaArgs a =
      gma_args(fn, q, k, v, mean, var_raw, prior_logit, true, eps, var_floor, check_finite);
  const Shape s = sequences_shape(fn, a.shape, offsets);
  const int64_t K = a.config.components;
  S0 = checked_state(fn, S0, "initial_state[0] (S)", {s.batch, s.heads, K, s.value_dim});
  z0 = checked_state(fn, z0, "initial_state[1] (z)", {s.batch, s.heads, K});
  at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, a.q.options());
  at::Tensor S = at::empty_like(S0), z = at::empty_like(z0);
  const GmaStateIO io{S0.data_ptr<double>(), z0.data_ptr<double>(), S.data_ptr<double>(),
                      z.data_ptr<double>()};
  const SavedPtr none;
  const SavedPtr& heads = prepared ? unbox(*prepared, "gma-prepared", a.q, fn) : none;
  bool used_prepared = false;
  SavedPtr rec = dispatch(a.q, [&](auto t) {
    using T = decltype(t);
    return gma_forward<T>(s, a.config, gma_inputs<T>(a), out.data_ptr<T>(), &io, heads,
                          &used_prepared, save);
  });
  return {out, S, z, box("gma-state", a.q, std::move(rec)), used_prepared};
}

std::vector<at::Tensor> gma_backward_state_py(at::Tensor q, at::Tensor k, at::Tensor v,
                                              at::Tensor mean, at::Tensor var_raw,
                                              at::Tensor prior_logit, at::Tensor grad_out,
                                              at::Tensor grad_S, at::Tensor grad_z,
                                              const SavedBox& saved, double eps, double var_floor,
                                              bool check_finite,
                                              const std::vector<int64_t>& offsets) {
  const std::string fn = "mixattn.gma_attention (backward)";
  const GmaArgs a =
      gma_args(fn, q, k, v, mean, var_raw, prior_logit, true, eps, var_floor, check_finite);
  const Shape s = sequences_shape(fn, a.shape, offsets);
  const int64_t K = a.config.components;
  grad_out = checked_grad_out(fn, grad_out, s, a.q);
  grad_S =
      checked_state(fn, grad_S, "grad of final_state[0] (S)", {s.batch, s.heads, K, s.value_dim});
  grad_z = checked_state(fn, grad_z, "grad of final_state[1] (z)", {s.batch, s.heads, K});
  const SavedPtr& rec = unbox(saved, "gma-state", a.q, fn);
  auto dq = at::empty_like(a.q), dk = at::empty_like(a.k), dv = at::empty_like(a.v);
  auto dmean = at::empty_like(a.mean), dvar = at::empty_like(a.var_raw);
  auto dprior = at::empty_like(a.prior_logit);
  auto dS0 = at::empty_like(grad_S), dz0 = at::empty_like(grad_z);
  const GmaStateGradIO io{grad_S.data_ptr<double>(), grad_z.data_ptr<double>(),
                          dS0.data_ptr<double>(), dz0.data_ptr<double>()};
  dispatch(a.q, [&](auto t) {
    using T = decltype(t);
    gma_backward<T>(s, a.config, gma_inputs<T>(a), grad_out.data_ptr<T>(), rec, dq.data_ptr<T>(),
                    dk.data_ptr<T>(), dv.data_ptr<T>(), dmean.data_ptr<T>(), dvar.data_ptr<T>(),
                    dprior.data_ptr<T>(), &io);
  });
  return {dq, dk, dv, dmean, dvar, dprior, dS0, dz0};
}

// --- packed (cu_seqlens) -----------------------------------------------------------------------

/// (1, H, T, d) -> (T, H, d) contiguous: the library's packed layout, T x (H d) row-major.
at::Tensor to_packed(const at::Tensor& t) {
  return t.select(0, 0).transpose(0, 1).contiguous();
}

/// (T, H, d) -> (1, H, T, d), a view.
at::Tensor from_packed(const at::Tensor& t) {
  return t.transpose(0, 1).unsqueeze(0);
}

template <class T>
GmaInputs<T> gma_packed_inputs(const GmaArgs& a, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v) {
  return {q.data_ptr<T>(),      k.data_ptr<T>(),         v.data_ptr<T>(),
          a.mean.data_ptr<T>(), a.var_raw.data_ptr<T>(), a.prior_logit.data_ptr<T>()};
}

std::tuple<at::Tensor, SavedBox> gma_forward_packed_py(at::Tensor q, at::Tensor k, at::Tensor v,
                                                       at::Tensor mean, at::Tensor var_raw,
                                                       at::Tensor prior_logit,
                                                       std::vector<int64_t> offsets, bool causal,
                                                       double eps, double var_floor,
                                                       bool check_finite) {
  const std::string fn = "mixattn.gma_attention";
  const GmaArgs a =
      gma_args(fn, q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor, check_finite);
  const PackedShape s = packed_shape(fn, a.shape, offsets);
  const at::Tensor pq = to_packed(a.q), pk = to_packed(a.k), pv = to_packed(a.v);
  at::Tensor out = at::empty({s.rows, s.heads, s.value_dim}, a.q.options());
  SavedPtr rec = dispatch(a.q, [&](auto t) {
    using T = decltype(t);
    return gma_forward_packed<T>(s, a.config, gma_packed_inputs<T>(a, pq, pk, pv),
                                 out.data_ptr<T>());
  });
  return {from_packed(out), box("gma-packed", a.q, std::move(rec))};
}

std::vector<at::Tensor> gma_backward_packed_py(at::Tensor q, at::Tensor k, at::Tensor v,
                                               at::Tensor mean, at::Tensor var_raw,
                                               at::Tensor prior_logit, at::Tensor grad_out,
                                               const SavedBox& saved, std::vector<int64_t> offsets,
                                               bool causal, double eps, double var_floor,
                                               bool check_finite) {
  const std::string fn = "mixattn.gma_attention (backward)";
  const GmaArgs a =
      gma_args(fn, q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor, check_finite);
  const PackedShape s = packed_shape(fn, a.shape, offsets);
  grad_out = to_packed(checked_grad_out(fn, grad_out, a.shape, a.q));
  const SavedPtr& rec = unbox(saved, "gma-packed", a.q, fn);
  const at::Tensor pq = to_packed(a.q), pk = to_packed(a.k), pv = to_packed(a.v);
  auto dq = at::empty_like(pq), dk = at::empty_like(pk), dv = at::empty_like(pv);
  auto dmean = at::empty_like(a.mean), dvar = at::empty_like(a.var_raw);
  auto dprior = at::empty_like(a.prior_logit);
  dispatch(a.q, [&](auto t) {
    using T = decltype(t);
    gma_backward_packed<T>(s, a.config, gma_packed_inputs<T>(a, pq, pk, pv), grad_out.data_ptr<T>(),
                           rec, dq.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>(),
                           dmean.data_ptr<T>(), dvar.data_ptr<T>(), dprior.data_ptr<T>());
  });
  return {from_packed(dq), from_packed(dk), from_packed(dv), dmean, dvar, dprior};
}

// --- OVQ ---------------------------------------------------------------------------------------

OvqConfig ovq_config(int64_t block, int64_t max_centroids, const std::string& growth,
                     double growth_alpha, const std::string& seeding, const std::string& assignment,
                     bool count_bias, bool grad_through_dictionary, double norm_eps,
                     bool check_finite) {
  using mixattn::ovq::Assignment;
  using mixattn::ovq::Growth;
  using mixattn::ovq::Seeding;
  const std::string fn = "mixattn.ovq_attention";
  OvqConfig c;
  c.block = block;
  c.max_centroids = max_centroids;
  if (growth != "plateau" && growth != "linear")
    fail(fn, "growth is '" + growth + "'; it must be 'plateau' or 'linear'");
  c.growth = growth == "linear" ? Growth::linear : Growth::plateau;
  c.growth_alpha = growth_alpha;
  if (seeding != "greedy_dispersion" && seeding != "one_shot")
    fail(fn, "seeding is '" + seeding + "'; it must be 'greedy_dispersion' or 'one_shot'");
  c.seeding = seeding == "one_shot" ? Seeding::one_shot : Seeding::greedy_dispersion;
  if (assignment != "all_centroids" && assignment != "existing_only")
    fail(fn, "assignment is '" + assignment + "'; it must be 'all_centroids' or 'existing_only'");
  c.assignment =
      assignment == "existing_only" ? Assignment::existing_only : Assignment::all_centroids;
  c.count_bias = count_bias;
  c.grad_through_dictionary = grad_through_dictionary;
  c.norm_eps = norm_eps;
  c.check_finite = check_finite;
  return c;
}

/// initial_state against the call: the same scalar type and (streams, heads, key dim, value
/// dim).
void check_start(const std::string& fn, const OvqStateBox& start, const Shape& s,
                 const at::Tensor& q, const at::Tensor& v, bool packed) {
  if (start.kind != ovq_state_kind(q) || !start.states)
    fail(fn, "initial_state holds " + start.kind + " dictionaries but q is " + dtype_name(q));
  if (!same_streams(start.shape, s))
    fail(fn, "initial_state was made for (batch or sequences, heads, key dim, value dim) = " +
                 stream_sizes(start.shape) + " but q has shape " + shape_of(q) + " and v has " +
                 shape_of(v) +
                 (packed ? " with " + std::to_string(s.batch) + " sequences" : std::string()));
}

/// The copying form: every pair continues a copy of initial_state's (or an empty) dictionary;
/// the end states come back as a new OvqStateBox.
std::tuple<at::Tensor, SavedBox, OvqStateBox> ovq_forward_py(at::Tensor q, at::Tensor k,
                                                             at::Tensor v, at::Tensor beta,
                                                             const OvqConfig& c,
                                                             const OvqStateBox* start, bool save,
                                                             const std::vector<int64_t>& offsets) {
  const std::string fn = "mixattn.ovq_attention";
  const Shape s = sequences_shape(fn, ovq_shape(fn, q, k, v, beta), offsets);
  if (start != nullptr) check_start(fn, *start, s, q, v, !offsets.empty());
  at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, q.options());
  std::unique_ptr<PairStates> states;
  SavedPtr rec = dispatch(q, [&](auto t) {
    using T = decltype(t);
    states = ovq_states<T>(s.batch * s.heads, s.key_dim, s.value_dim);
    return ovq_forward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                          beta.data_ptr<T>(), out.data_ptr<T>(), *states,
                          start != nullptr ? start->states.get() : nullptr, save);
  });
  // After the call: the library's checks of each pair's state run first and name the part that
  // does not fit the options; a state they accept but made under other options is refused here
  // (its copies are dropped, initial_state is as it was).
  if (start != nullptr && !same_state_options(start->config, c))
    fail(fn, "initial_state was made with " + state_options(start->config) + " but this call has " +
                 state_options(c));
  Shape kept = s;
  kept.queries = kept.keys = 0;
  kept.offsets.clear();
  return {out, box("ovq", q, std::move(rec)),
          OvqStateBox{ovq_state_kind(q), kept, c, std::move(states)}};
}

std::vector<at::Tensor> ovq_backward_py(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor beta,
                                        at::Tensor grad_out, const SavedBox& saved,
                                        const OvqConfig& c, const std::vector<int64_t>& offsets) {
  const std::string fn = "mixattn.ovq_attention (backward)";
  const Shape s = sequences_shape(fn, ovq_shape(fn, q, k, v, beta), offsets);
  grad_out = checked_grad_out(fn, grad_out, s, q);
  const SavedPtr& rec = unbox(saved, "ovq", q, fn);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  auto dbeta = at::empty_like(beta);
  dispatch(q, [&](auto t) {
    using T = decltype(t);
    ovq_backward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), beta.data_ptr<T>(),
                    grad_out.data_ptr<T>(), rec, dq.data_ptr<T>(), dk.data_ptr<T>(),
                    dv.data_ptr<T>(), dbeta.data_ptr<T>());
  });
  return {dq, dk, dv, dbeta};
}

// --- flash -------------------------------------------------------------------------------------

Shape flash_shape(const std::string& fn, at::Tensor& q, at::Tensor& k, at::Tensor& v, bool causal) {
  const Shape s = attention_shape(fn, q, k, v);
  if (causal && s.queries != s.keys)
    fail(fn, "causal needs as many queries as keys, but q has shape " + shape_of(q) +
                 " and k has " + shape_of(k));
  return s;
}

std::tuple<at::Tensor, SavedBox> flash_forward_py(at::Tensor q, at::Tensor k, at::Tensor v,
                                                  bool causal, double scale, bool check_finite,
                                                  bool save) {
  const Shape s = flash_shape("mixattn.flash_attention", q, k, v, causal);
  const FlashConfig c{causal, scale, check_finite};
  at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, q.options());
  SavedPtr rec = dispatch(q, [&](auto t) {
    using T = decltype(t);
    return flash_forward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                            out.data_ptr<T>(), save);
  });
  return {out, box("flash", q, std::move(rec))};
}

std::vector<at::Tensor> flash_backward_py(at::Tensor q, at::Tensor k, at::Tensor v,
                                          at::Tensor grad_out, const SavedBox& saved, bool causal,
                                          double scale, bool check_finite) {
  const std::string fn = "mixattn.flash_attention (backward)";
  const Shape s = flash_shape(fn, q, k, v, causal);
  grad_out = checked_grad_out(fn, grad_out, s, q);
  const SavedPtr& rec = unbox(saved, "flash", q, fn);
  const FlashConfig c{causal, scale, check_finite};
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  dispatch(q, [&](auto t) {
    using T = decltype(t);
    flash_backward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                      grad_out.data_ptr<T>(), rec, dq.data_ptr<T>(), dk.data_ptr<T>(),
                      dv.data_ptr<T>());
  });
  return {dq, dk, dv};
}

std::tuple<at::Tensor, SavedBox> flash_forward_packed_py(at::Tensor q, at::Tensor k, at::Tensor v,
                                                         std::vector<int64_t> offsets, bool causal,
                                                         double scale, bool check_finite) {
  const std::string fn = "mixattn.flash_attention";
  const PackedShape s = packed_shape(fn, flash_shape(fn, q, k, v, causal), offsets);
  const FlashConfig c{causal, scale, check_finite};
  const at::Tensor pq = to_packed(q), pk = to_packed(k), pv = to_packed(v);
  at::Tensor out = at::empty({s.rows, s.heads, s.value_dim}, q.options());
  SavedPtr rec = dispatch(q, [&](auto t) {
    using T = decltype(t);
    return flash_forward_packed<T>(s, c, pq.data_ptr<T>(), pk.data_ptr<T>(), pv.data_ptr<T>(),
                                   out.data_ptr<T>());
  });
  return {from_packed(out), box("flash-packed", q, std::move(rec))};
}

std::vector<at::Tensor> flash_backward_packed_py(at::Tensor q, at::Tensor k, at::Tensor v,
                                                 at::Tensor grad_out, const SavedBox& saved,
                                                 std::vector<int64_t> offsets, bool causal,
                                                 double scale, bool check_finite) {
  const std::string fn = "mixattn.flash_attention (backward)";
  const Shape full = flash_shape(fn, q, k, v, causal);
  const PackedShape s = packed_shape(fn, full, offsets);
  grad_out = to_packed(checked_grad_out(fn, grad_out, full, q));
  const SavedPtr& rec = unbox(saved, "flash-packed", q, fn);
  const FlashConfig c{causal, scale, check_finite};
  const at::Tensor pq = to_packed(q), pk = to_packed(k), pv = to_packed(v);
  auto dq = at::empty_like(pq), dk = at::empty_like(pk), dv = at::empty_like(pv);
  dispatch(q, [&](auto t) {
    using T = decltype(t);
    flash_backward_packed<T>(s, c, pq.data_ptr<T>(), pk.data_ptr<T>(), pv.data_ptr<T>(),
                             grad_out.data_ptr<T>(), rec, dq.data_ptr<T>(), dk.data_ptr<T>(),
                             dv.data_ptr<T>());
  });
  return {from_packed(dq), from_packed(dk), from_packed(dv)};
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
  py::class_<mt::SavedBox>(m, "Saved", "What a forward keeps for its backward (opaque).")
      .def_property_readonly("kind", [](const mt::SavedBox& b) { return b.kind; });
  py::class_<mt::OvqStateBox>(m, "OvqState",
                              "The dictionaries an ovq_attention call ended with, one per "
                              "(batch, head), or (sequence, head) of a packed call (opaque; no "
                              "gradient flows through it).")
      .def_property_readonly("batch", [](const mt::OvqStateBox& b) { return b.shape.batch; })
      .def_property_readonly("heads", [](const mt::OvqStateBox& b) { return b.shape.heads; })
      .def_property_readonly("kind", [](const mt::OvqStateBox& b) { return b.kind; })
      .def_property_readonly("tokens_seen",
                             [](const mt::OvqStateBox& b) { return b.states->tokens_seen(); });
  py::class_<mt::OvqConfig>(m, "OvqConfig")
      .def(py::init(&mt::ovq_config), py::arg("block"), py::arg("max_centroids"), py::arg("growth"),
           py::arg("growth_alpha"), py::arg("seeding"), py::arg("assignment"),
           py::arg("count_bias"), py::arg("grad_through_dictionary"), py::arg("norm_eps"),
           py::arg("check_finite"))
      .def("__repr__",
           [](const mt::OvqConfig& c) { return "OvqConfig(" + mt::state_options(c) + ")"; });
  // The kernels release the GIL: other Python threads (DDP's reducer, data loaders) run meanwhile.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("gma_forward", &mt::gma_forward_py, nogil);
  m.def("gma_backward", &mt::gma_backward_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("mean"), py::arg("var_raw"), py::arg("prior_logit"), py::arg("grad_out"),
        py::arg("saved"), py::arg("causal"), py::arg("eps"), py::arg("var_floor"),
        py::arg("check_finite"), py::arg("offsets") = std::vector<int64_t>{}, nogil);
  m.def("gma_prepare", &mt::gma_prepare_py, nogil);
  m.def("gma_forward_state", &mt::gma_forward_state_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("mean"), py::arg("var_raw"), py::arg("prior_logit"), py::arg("S0"), py::arg("z0"),
        py::arg("eps"), py::arg("var_floor"), py::arg("check_finite"),
        py::arg("prepared") = nullptr, py::arg("save") = true,
        py::arg("offsets") = std::vector<int64_t>{}, nogil);
  m.def("gma_backward_state", &mt::gma_backward_state_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("mean"), py::arg("var_raw"), py::arg("prior_logit"), py::arg("grad_out"),
        py::arg("grad_S"), py::arg("grad_z"), py::arg("saved"), py::arg("eps"),
        py::arg("var_floor"), py::arg("check_finite"), py::arg("offsets") = std::vector<int64_t>{},
        nogil);
  m.def("ovq_forward", &mt::ovq_forward_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("beta"), py::arg("config"), py::arg("initial_state"), py::arg("save"),
        py::arg("offsets") = std::vector<int64_t>{}, nogil);
  m.def("ovq_backward", &mt::ovq_backward_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("beta"), py::arg("grad_out"), py::arg("saved"), py::arg("config"),
        py::arg("offsets") = std::vector<int64_t>{}, nogil);
  m.def("flash_forward", &mt::flash_forward_py, nogil);
  m.def("flash_backward", &mt::flash_backward_py, nogil);
  m.def("gma_forward_packed", &mt::gma_forward_packed_py, nogil);
  m.def("gma_backward_packed", &mt::gma_backward_packed_py, nogil);
  m.def("flash_forward_packed", &mt::flash_forward_packed_py, nogil);
  m.def("flash_backward_packed", &mt::flash_backward_packed_py, nogil);
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
