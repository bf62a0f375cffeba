// python/csrc/ops.cpp — the registered operators torch.ops.mixattn.*: schemas (TORCH_LIBRARY)
// and their CPU kernels (TORCH_LIBRARY_IMPL): argument checks, tensor allocation and dtype
// dispatch in front of the kernels (kernels.hpp). Every forward returns, beside its outputs, its
// record for the backward as a handle (bindings.hpp); the backward operators take it back. The
// autograd formulas and the fake (meta) implementations are registered from Python
// (mixattn/_ops.py), with torch.library.register_autograd and register_fake.
//
// Every operator is functional except the cache forwards (caches.cpp), whose schemas mark the
// cache they continue in place as mutated (Tensor(a!)).
#include "bindings.hpp"

#include <torch/library.h>

#include <optional>
#include <tuple>

namespace mixattn_torch {
namespace {

using Opt = std::optional<at::Tensor>;
using Two = std::tuple<at::Tensor, at::Tensor>;

// --- GMA ---------------------------------------------------------------------------------------

/// (1, H, T, d) -> (T, H, d) contiguous: the library's packed layout, T x (H d) row-major.
at::Tensor to_packed(const at::Tensor& t) {
  return t.select(0, 0).transpose(0, 1).contiguous();
}

/// (T, H, d) -> (1, H, T, d), contiguous.
at::Tensor from_packed(const at::Tensor& t) {
  return t.transpose(0, 1).unsqueeze(0).contiguous();
}

template <class T>
GmaInputs<T> gma_packed_inputs(const GmaArgs& a, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v) {
  return {q.data_ptr<T>(),      k.data_ptr<T>(),         v.data_ptr<T>(),
          a.mean.data_ptr<T>(), a.var_raw.data_ptr<T>(), a.prior_logit.data_ptr<T>()};
}

Two gma_forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& mean, const at::Tensor& var_raw, const at::Tensor& prior_logit,
                   bool causal, double eps, double var_floor, bool check_finite, bool save,
                   const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Two {
    const std::string fn = "mixattn.gma_attention";
    const GmaArgs a =
        gma_args(fn, q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor, check_finite);
    const std::vector<int64_t> offsets = offsets_of(fn, cu_seqlens, a.q);
    if (!offsets.empty()) {
      const PackedShape s = packed_shape(fn, a.shape, offsets);
      const at::Tensor pq = to_packed(a.q), pk = to_packed(a.k), pv = to_packed(a.v);
      at::Tensor out = at::empty({s.rows, s.heads, s.value_dim}, a.q.options());
      // The packed kernel keeps its record whatever `save` says (one per call, not per pair).
      SavedPtr rec = dispatch(a.q, [&](auto t) {
        using T = decltype(t);
        return gma_forward_packed<T>(s, a.config, gma_packed_inputs<T>(a, pq, pk, pv),
                                     out.data_ptr<T>());
      });
      return {from_packed(out), record_handle("gma-packed", a.q, save ? rec : nullptr)};
    }
    const Shape& s = a.shape;
    at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, a.q.options());
    SavedPtr rec = dispatch(a.q, [&](auto t) {
      using T = decltype(t);
      return gma_forward<T>(s, a.config, gma_inputs<T>(a), out.data_ptr<T>(), nullptr, nullptr,
                            nullptr, save);
    });
    return {out, record_handle("gma", a.q, std::move(rec))};
  });
}

using Six = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

Six gma_backward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& mean, const at::Tensor& var_raw,
                    const at::Tensor& prior_logit, const at::Tensor& grad_out,
                    const at::Tensor& saved, bool causal, double eps, double var_floor,
                    bool check_finite, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Six {
    const std::string fn = "mixattn.gma_attention (backward)";
    const GmaArgs a =
        gma_args(fn, q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor, check_finite);
    const std::vector<int64_t> offsets = offsets_of(fn, cu_seqlens, a.q);
    auto dmean = at::empty_like(a.mean), dvar = at::empty_like(a.var_raw);
    auto dprior = at::empty_like(a.prior_logit);
    // A copy of a record (no object) is computed again by the forward: these inputs suffice.
    const auto again = [&] {
      return held_by(std::get<1>(gma_forward_op(q, k, v, mean, var_raw, prior_logit, causal, eps,
                                                var_floor, check_finite, true, cu_seqlens)))
          ->object;
    };
    const std::string kind = kind_named_by(saved);
    if (!offsets.empty() && starts_with(kind, "gma-packed/")) {
      const PackedShape s = packed_shape(fn, a.shape, offsets);
      const at::Tensor g = to_packed(checked_grad_out(fn, grad_out, a.shape, a.q));
      SavedPtr rec = record_of(saved, "gma-packed", a.q, fn, true);
      if (!rec) rec = again();
      const at::Tensor pq = to_packed(a.q), pk = to_packed(a.k), pv = to_packed(a.v);
      auto dq = at::empty_like(pq), dk = at::empty_like(pk), dv = at::empty_like(pv);
      dispatch(a.q, [&](auto t) {
        using T = decltype(t);
        gma_backward_packed<T>(s, a.config, gma_packed_inputs<T>(a, pq, pk, pv), g.data_ptr<T>(),
                               rec, dq.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>(),
                               dmean.data_ptr<T>(), dvar.data_ptr<T>(), dprior.data_ptr<T>());
      });
      return {from_packed(dq), from_packed(dk), from_packed(dv), dmean, dvar, dprior};
    }
    // A record of the pairs: a plain call's, or a cache's (whose packed calls run per pair, and
    // whose start state only the record holds).
    const Shape s = sequences_shape(fn, a.shape, offsets);
    const at::Tensor g = checked_grad_out(fn, grad_out, s, a.q);
    const bool cached = starts_with(kind, "gma-cache/");
    if (!cached && !offsets.empty())
      fail(fn, "saved was made by " + (kind.empty() ? std::string("nothing") : kind) +
                   ", not by gma-packed/" + dtype_name(a.q) + " (a packed call's forward)");
    SavedPtr rec = record_of(saved, cached ? "gma-cache" : "gma", a.q, fn, !cached);
    if (!rec) rec = again();
    auto dq = at::empty_like(a.q), dk = at::empty_like(a.k), dv = at::empty_like(a.v);
    dispatch(a.q, [&](auto t) {
      using T = decltype(t);
      gma_backward<T>(s, a.config, gma_inputs<T>(a), g.data_ptr<T>(), rec, dq.data_ptr<T>(),
                      dk.data_ptr<T>(), dv.data_ptr<T>(), dmean.data_ptr<T>(), dvar.data_ptr<T>(),
                      dprior.data_ptr<T>());
    });
    return {dq, dk, dv, dmean, dvar, dprior};
  });
}

using Four = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Four gma_forward_state_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& mean, const at::Tensor& var_raw,
                          const at::Tensor& prior_logit, const at::Tensor& S0_in,
                          const at::Tensor& z0_in, double eps, double var_floor, bool check_finite,
                          bool save, const Opt& cu_seqlens, const Opt& prepared) {
  return as_torch_errors([&]() -> Four {
    const std::string fn = "mixattn.gma_attention";
    const GmaArgs a =
        gma_args(fn, q, k, v, mean, var_raw, prior_logit, true, eps, var_floor, check_finite);
    const Shape s = sequences_shape(fn, a.shape, offsets_of(fn, cu_seqlens, a.q));
    const int64_t K = a.config.components;
    const at::Tensor S0 =
        checked_state(fn, S0_in, "initial_state[0] (S)", {s.batch, s.heads, K, s.value_dim});
    const at::Tensor z0 = checked_state(fn, z0_in, "initial_state[1] (z)", {s.batch, s.heads, K});
    at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, a.q.options());
    at::Tensor S = at::empty_like(S0), z = at::empty_like(z0);
    const GmaStateIO io{S0.data_ptr<double>(), z0.data_ptr<double>(), S.data_ptr<double>(),
                        z.data_ptr<double>()};
    // A prepared mixture (mixattn.functional's cache of them) of this call's dtype, if given.
    SavedPtr heads;
    Held* held = nullptr;
    if (prepared.has_value() && prepared->defined()) {
      held = const_cast<Held*>(held_by(*prepared));
      if (held == nullptr || held->kind != "gma-prepared/" + dtype_name(a.q))
        fail(fn, "prepared is not a prepared mixture of " + dtype_name(a.q) + " tensors");
      heads = held->object;
    }
    bool used_prepared = false;
    SavedPtr rec = dispatch(a.q, [&](auto t) {
      using T = decltype(t);
      return gma_forward<T>(s, a.config, gma_inputs<T>(a), out.data_ptr<T>(), &io, heads,
                            &used_prepared, save);
    });
    if (held != nullptr && !used_prepared) mark_stale(*held);
    return {out, S, z, record_handle("gma-state", a.q, std::move(rec))};
  });
}

using Eight = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                         at::Tensor, at::Tensor>;

Eight gma_backward_state_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mean, const at::Tensor& var_raw,
                            const at::Tensor& prior_logit, const at::Tensor& S0,
                            const at::Tensor& z0, const at::Tensor& grad_out, const Opt& grad_S_in,
                            const Opt& grad_z_in, const at::Tensor& saved, double eps,
                            double var_floor, bool check_finite, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Eight {
    const std::string fn = "mixattn.gma_attention (backward)";
    const GmaArgs a =
        gma_args(fn, q, k, v, mean, var_raw, prior_logit, true, eps, var_floor, check_finite);
    const Shape s = sequences_shape(fn, a.shape, offsets_of(fn, cu_seqlens, a.q));
    const int64_t K = a.config.components;
    const at::Tensor g = checked_grad_out(fn, grad_out, s, a.q);
    // An end state no loss reads has a zero gradient (autograd passes None for it).
    const auto state_grad = [&](const Opt& t, const char* name, std::vector<int64_t> sizes) {
      if (!t.has_value() || !t->defined())
        return at::zeros(sizes, a.q.options().dtype(at::kDouble));
      return checked_state(fn, *t, name, sizes);
    };
    const at::Tensor grad_S =
        state_grad(grad_S_in, "grad of final_state[0] (S)", {s.batch, s.heads, K, s.value_dim});
    const at::Tensor grad_z =
        state_grad(grad_z_in, "grad of final_state[1] (z)", {s.batch, s.heads, K});
    SavedPtr rec = record_of(saved, "gma-state", a.q, fn, true);
    if (!rec)  // a copy of the record: the forward again, from the same start state
      rec = held_by(std::get<3>(gma_forward_state_op(q, k, v, mean, var_raw, prior_logit, S0, z0,
                                                     eps, var_floor, check_finite, true, cu_seqlens,
                                                     std::nullopt)))
                ->object;
    auto dq = at::empty_like(a.q), dk = at::empty_like(a.k), dv = at::empty_like(a.v);
    auto dmean = at::empty_like(a.mean), dvar = at::empty_like(a.var_raw);
    auto dprior = at::empty_like(a.prior_logit);
    auto dS0 = at::empty_like(grad_S), dz0 = at::empty_like(grad_z);
    const GmaStateGradIO io{grad_S.data_ptr<double>(), grad_z.data_ptr<double>(),
                            dS0.data_ptr<double>(), dz0.data_ptr<double>()};
    dispatch(a.q, [&](auto t) {
      using T = decltype(t);
      gma_backward<T>(s, a.config, gma_inputs<T>(a), g.data_ptr<T>(), rec, dq.data_ptr<T>(),
                      dk.data_ptr<T>(), dv.data_ptr<T>(), dmean.data_ptr<T>(), dvar.data_ptr<T>(),
                      dprior.data_ptr<T>(), &io);
    });
    return {dq, dk, dv, dmean, dvar, dprior, dS0, dz0};
  });
}

// --- OVQ ---------------------------------------------------------------------------------------

/// initial_state against the call: the same scalar type and (streams, heads, key dim, value
/// dim).
const OvqStateBox& check_start(const std::string& fn, const at::Tensor& start, const Shape& s,
                               const at::Tensor& q, const at::Tensor& v, bool packed,
                               std::shared_ptr<const OvqStateBox>& keep) {
  const OvqStateBox* named = ovq_state_named_by(start, keep);
  if (named == nullptr)
    fail(fn,
         "initial_state must be the state an earlier ovq_attention(..., "
         "output_final_state=True) returned (or a copy of one that is still alive)");
  const auto& box = *named;
  if (box.kind != ovq_state_kind(q) || !box.states)
    fail(fn, "initial_state holds " + box.kind + " dictionaries but q is " + dtype_name(q));
  if (!same_streams(box.shape, s))
    fail(fn, "initial_state was made for (batch or sequences, heads, key dim, value dim) = " +
                 stream_sizes(box.shape) + " but q has shape " + shape_of(q) + " and v has " +
                 shape_of(v) +
                 (packed ? " with " + std::to_string(s.batch) + " sequences" : std::string()));
  return box;
}

/// The copying form: every pair continues a copy of initial_state's (or an empty) dictionary;
/// the end states come back as a new state handle.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ovq_forward_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& beta_in, int64_t block, int64_t max_centroids, c10::string_view growth,
    double growth_alpha, c10::string_view seeding, c10::string_view assignment, bool count_bias,
    bool grad_through_dictionary, double norm_eps, bool check_finite, bool save,
    const Opt& initial_state, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
    const std::string fn = "mixattn.ovq_attention";
    const OvqConfig c = ovq_config(fn, block, max_centroids, std::string(growth), growth_alpha,
                                   std::string(seeding), std::string(assignment), count_bias,
                                   grad_through_dictionary, norm_eps, check_finite);
    at::Tensor q = q_in, k = k_in, v = v_in, beta = beta_in;
    const Shape s =
        sequences_shape(fn, ovq_shape(fn, q, k, v, beta), offsets_of(fn, cu_seqlens, q));
    const bool given = initial_state.has_value() && initial_state->defined();
    std::shared_ptr<const OvqStateBox> keep;
    const OvqStateBox* start =
        given ? &check_start(fn, *initial_state, s, q, v, !s.offsets.empty(), keep) : nullptr;
    at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, q.options());
    std::unique_ptr<PairStates> states;
    SavedPtr rec = dispatch(q, [&](auto t) {
      using T = decltype(t);
      states = ovq_states<T>(s.batch * s.heads, s.key_dim, s.value_dim);
      return ovq_forward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                            beta.data_ptr<T>(), out.data_ptr<T>(), *states,
                            start != nullptr ? start->states.get() : nullptr, save);
    });
    // After the call: the library's checks of each pair's state run first and name the part
    // that does not fit the options; a state they accept but made under other options is
    // refused here (its copies are dropped, initial_state is as it was).
    if (start != nullptr && !same_state_options(start->config, c))
      fail(fn, "initial_state was made with " + state_options(start->config) +
                   " but this call has " + state_options(c));
    Shape kept = s;
    kept.queries = kept.keys = 0;
    kept.offsets.clear();
    OvqStateBox end{ovq_state_kind(q), kept, c,
                    std::shared_ptr<const PairStates>(std::move(states))};
    return {out, record_handle("ovq", q, std::move(rec)), ovq_state_handle(std::move(end))};
  });
}

Four ovq_backward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                     const at::Tensor& beta_in, const at::Tensor& grad_out, const at::Tensor& saved,
                     int64_t block, int64_t max_centroids, c10::string_view growth,
                     double growth_alpha, c10::string_view seeding, c10::string_view assignment,
                     bool count_bias, bool grad_through_dictionary, double norm_eps,
                     bool check_finite, const Opt& initial_state, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Four {
    const std::string fn = "mixattn.ovq_attention (backward)";
    const OvqConfig c = ovq_config(fn, block, max_centroids, std::string(growth), growth_alpha,
                                   std::string(seeding), std::string(assignment), count_bias,
                                   grad_through_dictionary, norm_eps, check_finite);
    at::Tensor q = q_in, k = k_in, v = v_in, beta = beta_in;
    const Shape s =
        sequences_shape(fn, ovq_shape(fn, q, k, v, beta), offsets_of(fn, cu_seqlens, q));
    const at::Tensor g = checked_grad_out(fn, grad_out, s, q);
    // A cache call's record holds the start state only it had; a copying call's start state is
    // initial_state (or empty), so a copy of its record is computed again.
    const bool cached = starts_with(kind_named_by(saved), "ovq-cache/");
    SavedPtr rec = record_of(saved, cached ? "ovq-cache" : "ovq", q, fn, !cached);
    if (!rec)
      rec = held_by(std::get<1>(ovq_forward_op(q_in, k_in, v_in, beta_in, block, max_centroids,
                                               growth, growth_alpha, seeding, assignment,
                                               count_bias, grad_through_dictionary, norm_eps,
                                               check_finite, true, initial_state, cu_seqlens)))
                ->object;
    auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    auto dbeta = at::empty_like(beta);
    dispatch(q, [&](auto t) {
      using T = decltype(t);
      ovq_backward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), beta.data_ptr<T>(),
                      g.data_ptr<T>(), rec, dq.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>(),
                      dbeta.data_ptr<T>());
    });
    return {dq, dk, dv, dbeta};
  });
}

// --- flash -------------------------------------------------------------------------------------

Shape flash_shape(const std::string& fn, at::Tensor& q, at::Tensor& k, at::Tensor& v, bool causal) {
  const Shape s = attention_shape(fn, q, k, v);
  if (causal && s.queries != s.keys)
    fail(fn, "causal needs as many queries as keys, but q has shape " + shape_of(q) +
                 " and k has " + shape_of(k));
  return s;
}

FlashConfig flash_config(const std::string& fn, bool causal, double scale, bool check_finite) {
  if (!std::isfinite(scale)) fail(fn, "scale is " + number(scale) + "; it must be finite");
  return FlashConfig{causal, scale, check_finite};
}

Two flash_forward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                     bool causal, double scale, bool check_finite, bool save,
                     const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Two {
    const std::string fn = "mixattn.flash_attention";
    at::Tensor q = q_in, k = k_in, v = v_in;
    const Shape full = flash_shape(fn, q, k, v, causal);
    const FlashConfig c = flash_config(fn, causal, scale, check_finite);
    const std::vector<int64_t> offsets = offsets_of(fn, cu_seqlens, q);
    if (!offsets.empty()) {
      const PackedShape s = packed_shape(fn, full, offsets);
      const at::Tensor pq = to_packed(q), pk = to_packed(k), pv = to_packed(v);
      at::Tensor out = at::empty({s.rows, s.heads, s.value_dim}, q.options());
      SavedPtr rec = dispatch(q, [&](auto t) {
        using T = decltype(t);
        return flash_forward_packed<T>(s, c, pq.data_ptr<T>(), pk.data_ptr<T>(), pv.data_ptr<T>(),
                                       out.data_ptr<T>());
      });
      return {from_packed(out), record_handle("flash-packed", q, save ? rec : nullptr)};
    }
    at::Tensor out = at::empty({full.batch, full.heads, full.queries, full.value_dim}, q.options());
    SavedPtr rec = dispatch(q, [&](auto t) {
      using T = decltype(t);
      return flash_forward<T>(full, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                              out.data_ptr<T>(), save);
    });
    return {out, record_handle("flash", q, std::move(rec))};
  });
}

using Three = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

Three flash_backward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                        const at::Tensor& grad_out, const at::Tensor& saved, bool causal,
                        double scale, bool check_finite, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Three {
    const std::string fn = "mixattn.flash_attention (backward)";
    at::Tensor q = q_in, k = k_in, v = v_in;
    const Shape full = flash_shape(fn, q, k, v, causal);
    const FlashConfig c = flash_config(fn, causal, scale, check_finite);
    const std::vector<int64_t> offsets = offsets_of(fn, cu_seqlens, q);
    const at::Tensor g = checked_grad_out(fn, grad_out, full, q);
    // A copy of a record (no object) is computed again by the forward: these inputs suffice.
    const auto again = [&] {
      return held_by(std::get<1>(flash_forward_op(q_in, k_in, v_in, causal, scale, check_finite,
                                                  true, cu_seqlens)))
          ->object;
    };
    if (!offsets.empty()) {
      const PackedShape s = packed_shape(fn, full, offsets);
      SavedPtr rec = record_of(saved, "flash-packed", q, fn, true);
      if (!rec) rec = again();
      const at::Tensor pq = to_packed(q), pk = to_packed(k), pv = to_packed(v), pg = to_packed(g);
      auto dq = at::empty_like(pq), dk = at::empty_like(pk), dv = at::empty_like(pv);
      dispatch(q, [&](auto t) {
        using T = decltype(t);
        flash_backward_packed<T>(s, c, pq.data_ptr<T>(), pk.data_ptr<T>(), pv.data_ptr<T>(),
                                 pg.data_ptr<T>(), rec, dq.data_ptr<T>(), dk.data_ptr<T>(),
                                 dv.data_ptr<T>());
      });
      return {from_packed(dq), from_packed(dk), from_packed(dv)};
    }
    SavedPtr rec = record_of(saved, "flash", q, fn, true);
    if (!rec) rec = again();
    auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    dispatch(q, [&](auto t) {
      using T = decltype(t);
      flash_backward<T>(full, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), g.data_ptr<T>(),
                        rec, dq.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>());
    });
    return {dq, dk, dv};
  });
}

}  // namespace
}  // namespace mixattn_torch

// The schemas. Options are plain arguments (ints, floats, bools, strings); cu_seqlens is a
// tensor (None: not packed) so that a compiled graph does not bake its values in; `saved` is a
// forward's record handle, `save=False` makes a forward keep none (no gradient will be asked).
// The trailing optional tensors default to None, and mixattn/_ops.py and functional.py pass them
// by name: a compiled graph's call leaves out a None it may take for a default, and only named
// arguments stay where they belong after one is left out.
TORCH_LIBRARY(mixattn, m) {
  m.def(
      "gma_forward(Tensor q, Tensor k, Tensor v, Tensor mean, Tensor var_raw, Tensor prior_logit, "
      "bool causal, float eps, float var_floor, bool check_finite, bool save, "
      "Tensor? cu_seqlens=None) -> (Tensor, Tensor)");
  m.def(
      "gma_backward(Tensor q, Tensor k, Tensor v, Tensor mean, Tensor var_raw, "
      "Tensor prior_logit, Tensor grad_out, Tensor saved, bool causal, float eps, "
      "float var_floor, bool check_finite, Tensor? cu_seqlens=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "gma_forward_state(Tensor q, Tensor k, Tensor v, Tensor mean, Tensor var_raw, "
      "Tensor prior_logit, Tensor S0, Tensor z0, float eps, float var_floor, bool check_finite, "
      "bool save, Tensor? cu_seqlens=None, Tensor? prepared=None) -> (Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "gma_backward_state(Tensor q, Tensor k, Tensor v, Tensor mean, Tensor var_raw, "
      "Tensor prior_logit, Tensor S0, Tensor z0, Tensor grad_out, Tensor? grad_S, "
      "Tensor? grad_z, Tensor saved, "
      "float eps, float var_floor, bool check_finite, Tensor? cu_seqlens=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "gma_forward_cached(Tensor q, Tensor k, Tensor v, Tensor mean, Tensor var_raw, "
      "Tensor prior_logit, Tensor(a!) cache, float eps, float var_floor, bool check_finite, "
      "bool save, Tensor? cu_seqlens=None) -> (Tensor, Tensor)");
  m.def(
      "ovq_forward(Tensor q, Tensor k, Tensor v, Tensor beta, int block, int max_centroids, "
      "str growth, float growth_alpha, str seeding, str assignment, bool count_bias, "
      "bool grad_through_dictionary, float norm_eps, bool check_finite, bool save, "
      "Tensor? initial_state=None, Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "ovq_backward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor grad_out, Tensor saved, "
      "int block, int max_centroids, str growth, float growth_alpha, str seeding, "
      "str assignment, bool count_bias, bool grad_through_dictionary, float norm_eps, "
      "bool check_finite, Tensor? initial_state=None, Tensor? cu_seqlens=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "ovq_forward_cached(Tensor q, Tensor k, Tensor v, Tensor beta, int block, "
      "int max_centroids, str growth, float growth_alpha, str seeding, str assignment, "
      "bool count_bias, bool grad_through_dictionary, float norm_eps, bool check_finite, "
      "Tensor(a!) cache, bool save, Tensor? cu_seqlens=None) -> (Tensor, Tensor)");
  m.def(
      "flash_forward(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool check_finite, "
      "bool save, Tensor? cu_seqlens=None) -> (Tensor, Tensor)");
  m.def(
      "flash_backward(Tensor q, Tensor k, Tensor v, Tensor grad_out, Tensor saved, bool causal, "
      "float scale, bool check_finite, Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mixattn, CPU, m) {
  namespace mt = mixattn_torch;
  m.impl("gma_forward", &mt::gma_forward_op);
  m.impl("gma_backward", &mt::gma_backward_op);
  m.impl("gma_forward_state", &mt::gma_forward_state_op);
  m.impl("gma_backward_state", &mt::gma_backward_state_op);
  m.impl("ovq_forward", &mt::ovq_forward_op);
  m.impl("ovq_backward", &mt::ovq_backward_op);
  m.impl("flash_forward", &mt::flash_forward_op);
  m.impl("flash_backward", &mt::flash_backward_op);
}
