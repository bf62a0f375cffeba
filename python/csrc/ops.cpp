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

// --- linear attention, Performer, static VQ, sliding window (SPEC 4-7) ---------------------------
//
// No state: every (b, h) pair, or (sequence, head) pair with cu_seqlens, is one call of the
// library's single-sequence operator. A packed call reads its (1, H, T, .) tensors in place.

/// q, k, v checked against each other; with cu_seqlens, (1, H, T, .) tensors holding the
/// sequences (Shape::offsets); `causal` (or packed) needs as many keys as queries.
Shape baseline_shape(const std::string& fn, at::Tensor& q, at::Tensor& k, at::Tensor& v,
                     bool causal, const Opt& cu_seqlens) {
  const Shape s = attention_shape(fn, q, k, v);
  if (causal && s.queries != s.keys)
    fail(fn, "causal needs as many queries as keys, but q has shape " + shape_of(q) +
                 " and k has " + shape_of(k));
  return sequences_shape(fn, s, offsets_of(fn, cu_seqlens, q));
}

LinearConfig linear_config(bool causal, double eps, bool check_finite) {
  LinearConfig c;
  c.causal = causal;
  c.eps = eps;
  c.check_finite = check_finite;
  return c;
}

/// The record `saved` holds for a backward, or the forward run again (`again`) for a copy of one.
template <class Again>
SavedPtr record_or_again(const at::Tensor& saved, const std::string& kind, const at::Tensor& q,
                         const std::string& fn, Again&& again) {
  SavedPtr rec = record_of(saved, kind, q, fn, true);
  return rec ? rec : held_by(again())->object;
}

Two linear_forward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                      bool causal, double eps, bool check_finite, bool save,
                      const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Two {
    const std::string fn = "mixattn.linear_attention";
    at::Tensor q = q_in, k = k_in, v = v_in;
    const Shape s = baseline_shape(fn, q, k, v, causal, cu_seqlens);
    const LinearConfig c = linear_config(causal, eps, check_finite);
    at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, q.options());
    SavedPtr rec = dispatch(q, [&](auto t) {
      using T = decltype(t);
      return linear_forward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                               out.data_ptr<T>(), save);
    });
    return {out, record_handle("linear", q, std::move(rec))};
  });
}

Three linear_backward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                         const at::Tensor& grad_out, const at::Tensor& saved, bool causal,
                         double eps, bool check_finite, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Three {
    const std::string fn = "mixattn.linear_attention (backward)";
    at::Tensor q = q_in, k = k_in, v = v_in;
    const Shape s = baseline_shape(fn, q, k, v, causal, cu_seqlens);
    const LinearConfig c = linear_config(causal, eps, check_finite);
    const at::Tensor g = checked_grad_out(fn, grad_out, s, q);
    const SavedPtr rec = record_or_again(saved, "linear", q, fn, [&] {
      return std::get<1>(
          linear_forward_op(q_in, k_in, v_in, causal, eps, check_finite, true, cu_seqlens));
    });
    auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    dispatch(q, [&](auto t) {
      using T = decltype(t);
      linear_backward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), g.data_ptr<T>(),
                         rec, dq.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>());
    });
    return {dq, dk, dv};
  });
}

/// Performer's or VQ's per-head matrix (H, rows, r): `name` (features, codebook) checked
/// against q; returns its rows (m, S), at least 1.
int64_t head_matrix(const std::string& fn, at::Tensor& t, const char* name, const Shape& s,
                    const at::Tensor& q, const char* rows) {
  t = checked(t, fn, name, 3, q);
  expect_size(fn, t, name, 0, s.heads, "heads of q");
  expect_size(fn, t, name, 2, s.key_dim, "key dim of q");
  if (t.size(1) < 1)
    fail(fn, std::string(name) + " has shape " + shape_of(t) + ": no " + rows + " (dimension 1)");
  return t.size(1);
}

template <class Config>
Config scaled_config(bool causal, double eps, double scale, bool check_finite) {
  Config c;
  c.causal = causal;
  c.eps = eps;
  c.scale = scale;
  c.check_finite = check_finite;
  return c;
}

Two performer_forward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                         const at::Tensor& features_in, bool causal, double eps, double scale,
                         bool check_finite, bool save, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Two {
    const std::string fn = "mixattn.performer_attention";
    at::Tensor q = q_in, k = k_in, v = v_in, w = features_in;
    const Shape s = baseline_shape(fn, q, k, v, causal, cu_seqlens);
    const int64_t m = head_matrix(fn, w, "features", s, q, "features");
    const auto c = scaled_config<PerformerConfig>(causal, eps, scale, check_finite);
    at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, q.options());
    SavedPtr rec = dispatch(q, [&](auto t) {
      using T = decltype(t);
      return performer_forward<T>(s, c, m, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                                  w.data_ptr<T>(), out.data_ptr<T>(), save);
    });
    return {out, record_handle("performer", q, std::move(rec))};
  });
}

Three performer_backward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const at::Tensor& features_in, const at::Tensor& grad_out,
                            const at::Tensor& saved, bool causal, double eps, double scale,
                            bool check_finite, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Three {
    const std::string fn = "mixattn.performer_attention (backward)";
    at::Tensor q = q_in, k = k_in, v = v_in, w = features_in;
    const Shape s = baseline_shape(fn, q, k, v, causal, cu_seqlens);
    const int64_t m = head_matrix(fn, w, "features", s, q, "features");
    const auto c = scaled_config<PerformerConfig>(causal, eps, scale, check_finite);
    const at::Tensor g = checked_grad_out(fn, grad_out, s, q);
    const SavedPtr rec = record_or_again(saved, "performer", q, fn, [&] {
      return std::get<1>(performer_forward_op(q_in, k_in, v_in, features_in, causal, eps, scale,
                                              check_finite, true, cu_seqlens));
    });
    auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    dispatch(q, [&](auto t) {
      using T = decltype(t);
      performer_backward<T>(s, c, m, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                            w.data_ptr<T>(), g.data_ptr<T>(), rec, dq.data_ptr<T>(),
                            dk.data_ptr<T>(), dv.data_ptr<T>());
    });
    return {dq, dk, dv};
  });
}

Two vq_forward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                  const at::Tensor& codebook_in, bool causal, double eps, double scale,
                  bool check_finite, bool save, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Two {
    const std::string fn = "mixattn.vq_attention";
    at::Tensor q = q_in, k = k_in, v = v_in, cb = codebook_in;
    const Shape s = baseline_shape(fn, q, k, v, causal, cu_seqlens);
    const int64_t codes = head_matrix(fn, cb, "codebook", s, q, "codes");
    const auto c = scaled_config<VqConfig>(causal, eps, scale, check_finite);
    at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, q.options());
    SavedPtr rec = dispatch(q, [&](auto t) {
      using T = decltype(t);
      return vq_forward<T>(s, c, codes, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                           cb.data_ptr<T>(), out.data_ptr<T>(), save);
    });
    return {out, record_handle("vq", q, std::move(rec))};
  });
}

Four vq_backward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                    const at::Tensor& codebook_in, const at::Tensor& grad_out,
                    const at::Tensor& saved, bool causal, double eps, double scale,
                    bool check_finite, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Four {
    const std::string fn = "mixattn.vq_attention (backward)";
    at::Tensor q = q_in, k = k_in, v = v_in, cb = codebook_in;
    const Shape s = baseline_shape(fn, q, k, v, causal, cu_seqlens);
    const int64_t codes = head_matrix(fn, cb, "codebook", s, q, "codes");
    const auto c = scaled_config<VqConfig>(causal, eps, scale, check_finite);
    const at::Tensor g = checked_grad_out(fn, grad_out, s, q);
    const SavedPtr rec = record_or_again(saved, "vq", q, fn, [&] {
      return std::get<1>(vq_forward_op(q_in, k_in, v_in, codebook_in, causal, eps, scale,
                                       check_finite, true, cu_seqlens));
    });
    auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    auto dcb = at::empty_like(cb);
    dispatch(q, [&](auto t) {
      using T = decltype(t);
      vq_backward<T>(s, c, codes, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                     cb.data_ptr<T>(), g.data_ptr<T>(), rec, dq.data_ptr<T>(), dk.data_ptr<T>(),
                     dv.data_ptr<T>(), dcb.data_ptr<T>());
    });
    return {dq, dk, dv, dcb};
  });
}

WindowConfig window_config(int64_t window, double scale, bool check_finite) {
  WindowConfig c;
  c.window = window;
  c.scale = scale;
  c.check_finite = check_finite;
  return c;
}

Two window_forward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                      int64_t window, double scale, bool check_finite, bool save,
                      const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Two {
    const std::string fn = "mixattn.sliding_window_attention";
    at::Tensor q = q_in, k = k_in, v = v_in;
    const Shape s = baseline_shape(fn, q, k, v, true, cu_seqlens);
    const WindowConfig c = window_config(window, scale, check_finite);
    at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, q.options());
    SavedPtr rec = dispatch(q, [&](auto t) {
      using T = decltype(t);
      return window_forward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                               out.data_ptr<T>(), save);
    });
    return {out, record_handle("window", q, std::move(rec))};
  });
}

Three window_backward_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                         const at::Tensor& grad_out, const at::Tensor& saved, int64_t window,
                         double scale, bool check_finite, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Three {
    const std::string fn = "mixattn.sliding_window_attention (backward)";
    at::Tensor q = q_in, k = k_in, v = v_in;
    const Shape s = baseline_shape(fn, q, k, v, true, cu_seqlens);
    const WindowConfig c = window_config(window, scale, check_finite);
    const at::Tensor g = checked_grad_out(fn, grad_out, s, q);
    const SavedPtr rec = record_or_again(saved, "window", q, fn, [&] {
      return std::get<1>(
          window_forward_op(q_in, k_in, v_in, window, scale, check_finite, true, cu_seqlens));
    });
    auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    dispatch(q, [&](auto t) {
      using T = decltype(t);
      window_backward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), g.data_ptr<T>(),
                         rec, dq.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>());
    });
    return {dq, dk, dv};
  });
}

// --- The gated delta rule (SPEC 9) ---------------------------------------------------------------
//
// Causal, with a state per (batch entry or packed sequence, head): every call continues
// initial_state (zeros when none is given) and returns its end state, S (streams, H, d_k, d_v)
// float64. Without cu_seqlens each (b, h) pair is one delta::forward_into reading its blocks in
// place; with them, the library's packed entry point (delta::forward_packed_into) runs the
// (sequence, head) items.

struct DeltaArgs {
  Shape shape;  // with cu_seqlens: the sequences, one state each (Shape::offsets)
  DeltaConfig config;
  at::Tensor q, k, v, g, beta;
};

/// A gate (g or beta): (B, H, N), the first three sizes of q.
at::Tensor delta_gate(const std::string& fn, const at::Tensor& t, const char* name,
                      const at::Tensor& q) {
  at::Tensor c = checked(t, fn, name, 3, q);
  expect_size(fn, c, name, 0, q.size(0), "batch of q");
  expect_size(fn, c, name, 1, q.size(1), "heads of q");
  expect_size(fn, c, name, 2, q.size(2), "tokens of q");
  return c;
}

DeltaArgs delta_args(const std::string& fn, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale,
                     bool normalize, int64_t chunk, bool check_finite, const Opt& cu_seqlens) {
  DeltaArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  const Shape s = attention_shape(fn, a.q, a.k, a.v);
  if (s.keys != s.queries)
    fail(fn, "the gated delta rule is causal: k has shape " + shape_of(a.k) + " but q has " +
                 shape_of(a.q) + " (as many tokens needed)");
  a.g = delta_gate(fn, g, "g", a.q);
  a.beta = delta_gate(fn, beta, "beta", a.q);
  if (chunk < 1) fail(fn, "chunk_size is " + std::to_string(chunk) + "; it must be >= 1");
  if (!std::isfinite(scale) || scale < 0)
    fail(fn, "scale is " + number(scale) + "; it must be finite and > 0 (0: 1/sqrt(d_k))");
  a.config.chunk = chunk;
  a.config.scale = scale;
  a.config.normalize = normalize;
  a.config.check_finite = check_finite;
  a.shape = sequences_shape(fn, s, offsets_of(fn, cu_seqlens, a.q));
  return a;
}

template <class T>
DeltaInputs<T> delta_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const DeltaArgs& a) {
  return {q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), a.g.data_ptr<T>(),
          a.beta.data_ptr<T>()};
}

/// A state tensor (initial_state, or the gradient of final_state): dense CPU float64 of sizes
/// (streams, heads, d_k, d_v), made contiguous.
at::Tensor delta_state(const std::string& fn, const at::Tensor& t, const char* name,
                       const Shape& s) {
  const std::vector<int64_t> sizes{s.batch, s.heads, s.key_dim, s.value_dim};
  if (t.device().type() != at::kCPU || t.layout() != at::kStrided)
    fail(fn, std::string(name) + " must be a dense CPU tensor, got a " + place_of(t) + " tensor");
  if (t.scalar_type() != at::kDouble)
    fail(fn, std::string(name) +
                 " must be float64 (the state's type for float32 and float64 inputs), got " +
                 dtype_name(t));
  if (t.sizes() != at::IntArrayRef(sizes)) {
    std::ostringstream want;
    want << at::IntArrayRef(sizes);
    fail(fn, std::string(name) + " has shape " + shape_of(t) + " but must be " + want.str() + " (" +
                 (s.offsets.empty() ? "batch" : "sequences") + ", heads, key dim, value dim)");
  }
  if (t.is_neg()) return t.resolve_neg().contiguous();
  return t.contiguous();
}

/// The packed call of a sequences shape (Shape::offsets).
PackedShape packed_of(const Shape& s) {
  PackedShape p;
  p.heads = s.heads;
  p.rows = s.queries;
  p.key_dim = s.key_dim;
  p.value_dim = s.value_dim;
  p.offsets = s.offsets;
  return p;
}

at::Tensor new_state(const Shape& s) {
  return at::empty({s.batch, s.heads, s.key_dim, s.value_dim},
                   at::TensorOptions().dtype(at::kDouble));
}

Three delta_forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& g, const at::Tensor& beta, double scale,
                       bool use_qk_l2norm_in_kernel, int64_t chunk_size, bool check_finite,
                       bool save, const Opt& initial_state, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Three {
    const std::string fn = "mixattn.gated_delta_rule";
    const DeltaArgs a = delta_args(fn, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, chunk_size,
                                   check_finite, cu_seqlens);
    const Shape& s = a.shape;
    const bool given = initial_state.has_value() && initial_state->defined();
    const at::Tensor S0 =
        given ? delta_state(fn, *initial_state, "initial_state", s) : at::Tensor();
    at::Tensor S = new_state(s);
    const DeltaStateIO io{given ? S0.data_ptr<double>() : nullptr, S.data_ptr<double>()};
    if (!s.offsets.empty()) {
      const PackedShape p = packed_of(s);
      const at::Tensor pq = to_packed(a.q), pk = to_packed(a.k), pv = to_packed(a.v);
      at::Tensor out = at::empty({p.rows, p.heads, p.value_dim}, a.q.options());
      SavedPtr rec = dispatch(a.q, [&](auto t) {
        using T = decltype(t);
        return delta_forward_packed<T>(p, a.config, delta_inputs<T>(pq, pk, pv, a),
                                       out.data_ptr<T>(), io, save);
      });
      return {from_packed(out), S, record_handle("delta-packed", a.q, std::move(rec))};
    }
    at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, a.q.options());
    SavedPtr rec = dispatch(a.q, [&](auto t) {
      using T = decltype(t);
      return delta_forward<T>(s, a.config, delta_inputs<T>(a.q, a.k, a.v, a), out.data_ptr<T>(), io,
                              save);
    });
    return {out, S, record_handle("delta", a.q, std::move(rec))};
  });
}

template <class T>
DeltaGrads<T> delta_grads(at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dg,
                          at::Tensor& dbeta) {
  return {dq.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>(), dg.data_ptr<T>(),
          dbeta.data_ptr<T>()};
}

Six delta_backward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor& grad_out,
                      const at::Tensor& saved, double scale, bool use_qk_l2norm_in_kernel,
                      int64_t chunk_size, bool check_finite, const Opt& grad_final_state,
                      const Opt& initial_state, const Opt& cu_seqlens) {
  return as_torch_errors([&]() -> Six {
    const std::string fn = "mixattn.gated_delta_rule (backward)";
    const DeltaArgs a = delta_args(fn, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, chunk_size,
                                   check_finite, cu_seqlens);
    const Shape& s = a.shape;
    const at::Tensor go = checked_grad_out(fn, grad_out, s, a.q);
    // An end state no loss reads has a zero gradient (autograd may pass None for it).
    const bool end_read = grad_final_state.has_value() && grad_final_state->defined();
    const at::Tensor dS =
        end_read ? delta_state(fn, *grad_final_state, "grad of final_state", s) : at::Tensor();
    const bool packed = !s.offsets.empty();
    const SavedPtr rec = record_or_again(saved, packed ? "delta-packed" : "delta", a.q, fn, [&] {
      return std::get<2>(delta_forward_op(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel,
                                          chunk_size, check_finite, true, initial_state,
                                          cu_seqlens));
    });
    at::Tensor dS0 = new_state(s);
    const DeltaStateGradIO io{end_read ? dS.data_ptr<double>() : nullptr, dS0.data_ptr<double>()};
    auto dg = at::empty_like(a.g), dbeta = at::empty_like(a.beta);
    if (packed) {
      const PackedShape p = packed_of(s);
      const at::Tensor pq = to_packed(a.q), pk = to_packed(a.k), pv = to_packed(a.v);
      const at::Tensor pg = to_packed(go);
      auto dq = at::empty_like(pq), dk = at::empty_like(pk), dv = at::empty_like(pv);
      dispatch(a.q, [&](auto t) {
        using T = decltype(t);
        delta_backward_packed<T>(p, a.config, delta_inputs<T>(pq, pk, pv, a), pg.data_ptr<T>(), rec,
                                 delta_grads<T>(dq, dk, dv, dg, dbeta), io);
      });
      return {from_packed(dq), from_packed(dk), from_packed(dv), dg, dbeta, dS0};
    }
    auto dq = at::empty_like(a.q), dk = at::empty_like(a.k), dv = at::empty_like(a.v);
    dispatch(a.q, [&](auto t) {
      using T = decltype(t);
      delta_backward<T>(s, a.config, delta_inputs<T>(a.q, a.k, a.v, a), go.data_ptr<T>(), rec,
                        delta_grads<T>(dq, dk, dv, dg, dbeta), io);
    });
    return {dq, dk, dv, dg, dbeta, dS0};
  });
}

// --- RoPE (SPEC 8) -------------------------------------------------------------------------------

/// x (B, H, N, r) rotated (rope::apply_into per pair), or rotated back (`backward`: x is then
/// the gradient of the output, rope::backward_into). With cu_seqlens, positions restart at
/// `start` in every sequence.
at::Tensor rope_op(const std::string& fn, const char* name, const at::Tensor& x_in, int64_t start,
                   double base, bool check_finite, const Opt& cu_seqlens, bool backward) {
  return as_torch_errors([&]() -> at::Tensor {
    at::Tensor x = checked(x_in, fn, name, 4, x_in);
    Shape s;
    s.batch = x.size(0);
    s.heads = x.size(1);
    s.queries = s.keys = x.size(2);
    s.key_dim = s.value_dim = x.size(3);
    s = sequences_shape(fn, s, offsets_of(fn, cu_seqlens, x));
    RopeConfig c;
    c.base = base;
    c.check_finite = check_finite;
    at::Tensor out = at::empty_like(x);
    dispatch(x, [&](auto t) {
      using T = decltype(t);
      rope_rotate<T>(s, c, start, x.data_ptr<T>(), out.data_ptr<T>(), backward);
    });
    return out;
  });
}

at::Tensor rope_forward_op(const at::Tensor& x, int64_t start, double base, bool check_finite,
                           const Opt& cu_seqlens) {
  return rope_op("mixattn.rope", "x", x, start, base, check_finite, cu_seqlens, false);
}

at::Tensor rope_backward_op(const at::Tensor& grad_out, int64_t start, double base,
                            bool check_finite, const Opt& cu_seqlens) {
  return rope_op("mixattn.rope (backward)", "grad_out", grad_out, start, base, check_finite,
                 cu_seqlens, true);
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
  m.def(
      "linear_forward(Tensor q, Tensor k, Tensor v, bool causal, float eps, bool check_finite, "
      "bool save, Tensor? cu_seqlens=None) -> (Tensor, Tensor)");
  m.def(
      "linear_backward(Tensor q, Tensor k, Tensor v, Tensor grad_out, Tensor saved, bool causal, "
      "float eps, bool check_finite, Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "performer_forward(Tensor q, Tensor k, Tensor v, Tensor features, bool causal, float eps, "
      "float scale, bool check_finite, bool save, Tensor? cu_seqlens=None) -> (Tensor, Tensor)");
  m.def(
      "performer_backward(Tensor q, Tensor k, Tensor v, Tensor features, Tensor grad_out, "
      "Tensor saved, bool causal, float eps, float scale, bool check_finite, "
      "Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "vq_forward(Tensor q, Tensor k, Tensor v, Tensor codebook, bool causal, float eps, "
      "float scale, bool check_finite, bool save, Tensor? cu_seqlens=None) -> (Tensor, Tensor)");
  m.def(
      "vq_backward(Tensor q, Tensor k, Tensor v, Tensor codebook, Tensor grad_out, Tensor saved, "
      "bool causal, float eps, float scale, bool check_finite, Tensor? cu_seqlens=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "window_forward(Tensor q, Tensor k, Tensor v, int window, float scale, bool check_finite, "
      "bool save, Tensor? cu_seqlens=None) -> (Tensor, Tensor)");
  m.def(
      "window_backward(Tensor q, Tensor k, Tensor v, Tensor grad_out, Tensor saved, int window, "
      "float scale, bool check_finite, Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor)");
  // The gated delta rule: causal, with a state always returned (S (streams, H, d_k, d_v),
  // float64); initial_state None starts from zeros, grad_final_state None is a zero gradient.
  m.def(
      "delta_forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
      "bool use_qk_l2norm_in_kernel, int chunk_size, bool check_finite, bool save, "
      "Tensor? initial_state=None, Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "delta_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor grad_out, "
      "Tensor saved, float scale, bool use_qk_l2norm_in_kernel, int chunk_size, "
      "bool check_finite, Tensor? grad_final_state=None, Tensor? initial_state=None, "
      "Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // RoPE keeps no record (its backward is the inverse rotation); start is a SymInt so that a
  // compiled decoding loop does not specialise on every position.
  m.def(
      "rope_forward(Tensor x, SymInt start, float base, bool check_finite, "
      "Tensor? cu_seqlens=None) -> Tensor");
  m.def(
      "rope_backward(Tensor grad_out, SymInt start, float base, bool check_finite, "
      "Tensor? cu_seqlens=None) -> Tensor");
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
  m.impl("linear_forward", &mt::linear_forward_op);
  m.impl("linear_backward", &mt::linear_backward_op);
  m.impl("performer_forward", &mt::performer_forward_op);
  m.impl("performer_backward", &mt::performer_backward_op);
  m.impl("vq_forward", &mt::vq_forward_op);
  m.impl("vq_backward", &mt::vq_backward_op);
  m.impl("window_forward", &mt::window_forward_op);
  m.impl("window_backward", &mt::window_backward_op);
  m.impl("delta_forward", &mt::delta_forward_op);
  m.impl("delta_backward", &mt::delta_backward_op);
  m.impl("rope_forward", &mt::rope_forward_op);
  m.impl("rope_backward", &mt::rope_backward_op);
}
