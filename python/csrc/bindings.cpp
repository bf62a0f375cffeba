// python/csrc/bindings.cpp — the extension module mixattn._C: argument checks, tensor
// allocation and dtype dispatch in front of the kernels (kernels.hpp). The autograd wiring is
// in Python (mixattn/functional.py, torch.autograd.Function); these functions see contiguous
// CPU tensors of one floating type and return plain tensors.
//
// Errors: bad shapes, dtypes or devices raise ValueError naming the Python function and the
// argument (std::invalid_argument); the library's own checks (non-finite inputs: ValueError
// from std::domain_error) pass through.
#include "kernels.hpp"

// torch/python.h (pybind11 with the tensor type casters) and ATen instead of torch/extension.h,
// which adds the whole C++ frontend (nn, optim, data) and doubles this file's compile time.
#include <ATen/ATen.h>
#include <torch/python.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace mixattn_torch {
namespace {

/// What a forward hands to Python for its backward: the kernels' record and which operator and
/// scalar type made it (a record is only ever read back as the type it was made as). A forward
/// told save=False (no gradient will be asked for) hands back a null record.
struct SavedBox {
  std::string kind;
  SavedPtr record;
};

[[noreturn]] void fail(const std::string& fn, const std::string& what) {
  throw std::invalid_argument(fn + ": " + what);
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

/// A dense CPU float32/float64 tensor of `dim` dimensions, of the same dtype as `like`, made
/// contiguous (a no-op when it already is).
at::Tensor checked(const at::Tensor& t, const std::string& fn, const char* name,
                      int64_t dim, const at::Tensor& like) {
  if (!t.defined()) fail(fn, std::string(name) + " is undefined");
  if (t.device().type() != at::kCPU || t.layout() != at::kStrided)
    fail(fn, std::string(name) + " must be a dense CPU tensor");
  if (t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble)
    fail(fn, std::string(name) + " must be float32 or float64, got " +
                 std::string(c10::toString(t.scalar_type())));
  if (t.scalar_type() != like.scalar_type())
    fail(fn, std::string(name) + " is " + std::string(c10::toString(t.scalar_type())) +
                 " but q is " + std::string(c10::toString(like.scalar_type())));
  if (t.dim() != dim)
    fail(fn, std::string(name) + " must have " + std::to_string(dim) + " dimensions, got shape " +
                 shape_of(t));
  return t.contiguous();
}

void expect_size(const std::string& fn, const at::Tensor& t, const char* name, int64_t axis,
                 int64_t want, const char* meaning) {
  if (t.size(axis) != want)
    fail(fn, std::string(name) + " has shape " + shape_of(t) + " but dimension " +
                 std::to_string(axis) + " must be " + std::to_string(want) + " (" + meaning + ")");
}

/// q (B, H, N, r), k (B, H, M, r), v (B, H, M, d_v) checked against each other.
Shape attention_shape(const std::string& fn, at::Tensor& q, at::Tensor& k,
                      at::Tensor& v) {
  q = checked(q, fn, "q", 4, q);
  k = checked(k, fn, "k", 4, q);
  v = checked(v, fn, "v", 4, q);
  Shape s;
  s.batch = q.size(0);
  s.heads = q.size(1);
  s.queries = q.size(2);
  s.key_dim = q.size(3);
  s.keys = k.size(2);
  s.value_dim = v.size(3);
  expect_size(fn, k, "k", 0, s.batch, "batch of q");
  expect_size(fn, k, "k", 1, s.heads, "heads of q");
  expect_size(fn, k, "k", 3, s.key_dim, "key dim of q");
  expect_size(fn, v, "v", 0, s.batch, "batch of q");
  expect_size(fn, v, "v", 1, s.heads, "heads of q");
  expect_size(fn, v, "v", 2, s.keys, "tokens of k");
  return s;
}

/// The batch dimension of the call's tensors: 1 for sequences packed along the tokens (Shape::
/// offsets, where s.batch counts the sequences).
int64_t tensor_batch(const Shape& s) { return s.offsets.empty() ? s.batch : 1; }

/// grad_out (B, H, N, d_v), like the forward's output.
at::Tensor checked_grad_out(const std::string& fn, const at::Tensor& grad_out, const Shape& s,
                            const at::Tensor& like) {
  at::Tensor g = checked(grad_out, fn, "grad_out", 4, like);
  if (g.sizes() != at::IntArrayRef({tensor_batch(s), s.heads, s.queries, s.value_dim}))
    fail(fn, "grad_out has shape " + shape_of(g) + ", not the output's");
  return g;
}

SavedBox box(const std::string& kind, const at::Tensor& like, SavedPtr record) {
  return SavedBox{kind + "/" + std::string(c10::toString(like.scalar_type())), std::move(record)};
}

const SavedPtr& unbox(const SavedBox& saved, const std::string& kind, const at::Tensor& like,
                      const std::string& fn) {
  const std::string want = kind + "/" + std::string(c10::toString(like.scalar_type()));
  if (saved.kind == want && !saved.record)
    fail(fn, "saved holds no record: its forward ran with no gradient to compute (save=False)");
  if (saved.kind != want)
    fail(fn, "saved was made by " + (saved.kind.empty() ? std::string("nothing") : saved.kind) +
                 ", not by " + want);
  return saved.record;
}

/// f(T{}) for the scalar type of `t` (checked() admitted only float32 and float64).
template <class F>
decltype(auto) dispatch(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) return f(float{});
  return f(double{});
}

// --- GMA ---------------------------------------------------------------------------------------

struct GmaArgs {
  Shape shape;
  GmaConfig config;
  at::Tensor q, k, v, mean, var_raw, prior_logit;
};

GmaArgs gma_args(const std::string& fn, at::Tensor q, at::Tensor k, at::Tensor v,
                 at::Tensor mean, at::Tensor var_raw, at::Tensor prior_logit,
                 bool causal, double eps, double var_floor, bool check_finite) {
  GmaArgs a;
  a.shape = attention_shape(fn, q, k, v);
  a.mean = checked(mean, fn, "mean", 3, q);
  a.var_raw = checked(var_raw, fn, "var_raw", 3, q);
  a.prior_logit = checked(prior_logit, fn, "prior_logit", 2, q);
  a.config.components = a.mean.size(1);
  expect_size(fn, a.mean, "mean", 0, a.shape.heads, "heads of q");
  expect_size(fn, a.mean, "mean", 2, a.shape.key_dim, "key dim of q");
  if (a.var_raw.sizes() != a.mean.sizes())
    fail(fn, "var_raw has shape " + shape_of(a.var_raw) + " but mean has " + shape_of(a.mean));
  expect_size(fn, a.prior_logit, "prior_logit", 0, a.shape.heads, "heads of q");
  expect_size(fn, a.prior_logit, "prior_logit", 1, a.config.components, "components of mean");
  if (causal && a.shape.queries != a.shape.keys)
    fail(fn, "causal needs as many queries as keys, but q has shape " + shape_of(q) +
                 " and k has " + shape_of(k));
  a.config.causal = causal;
  a.config.eps = eps;
  a.config.var_floor = var_floor;
  a.config.check_finite = check_finite;
  a.q = q;
  a.k = k;
  a.v = v;
  return a;
}

template <class T>
GmaInputs<T> gma_inputs(const GmaArgs& a) {
  return {a.q.data_ptr<T>(),    a.k.data_ptr<T>(),       a.v.data_ptr<T>(),
          a.mean.data_ptr<T>(), a.var_raw.data_ptr<T>(), a.prior_logit.data_ptr<T>()};
}

std::tuple<at::Tensor, SavedBox> gma_forward_py(at::Tensor q, at::Tensor k,
                                                   at::Tensor v, at::Tensor mean,
                                                   at::Tensor var_raw,
                                                   at::Tensor prior_logit, bool causal,
                                                   double eps, double var_floor,
                                                   bool check_finite, bool save) {
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

std::vector<at::Tensor> gma_backward_py(at::Tensor q, at::Tensor k, at::Tensor v,
                                           at::Tensor mean, at::Tensor var_raw,
                                           at::Tensor prior_logit, at::Tensor grad_out,
                                           const SavedBox& saved, bool causal, double eps,
                                           double var_floor, bool check_finite) {
  const std::string fn = "mixattn.gma_attention (backward)";
  const GmaArgs a = gma_args(fn, q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor,
                             check_finite);
  const Shape& s = a.shape;
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

/// A causal prefix state tensor (S: (B, H, K, d_v), z: (B, H, K)): dense CPU float64 of exactly
/// `sizes`, made contiguous.
at::Tensor checked_state(const std::string& fn, const at::Tensor& t, const char* name,
                         at::IntArrayRef sizes) {
  if (!t.defined()) fail(fn, std::string(name) + " is undefined");
  if (t.device().type() != at::kCPU || t.layout() != at::kStrided)
    fail(fn, std::string(name) + " must be a dense CPU tensor");
  if (t.scalar_type() != at::kDouble)
    fail(fn, std::string(name) + " must be float64 (the state's type for float32 and float64 "
                 "inputs), got " + std::string(c10::toString(t.scalar_type())));
  if (t.sizes() != sizes) {
    std::ostringstream want;
    want << sizes;
    fail(fn, std::string(name) + " has shape " + shape_of(t) + " but must be " + want.str() +
                 " (batch, heads, components" + (sizes.size() == 4 ? ", value dim)" : ")"));
  }
  return t.contiguous();
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

PackedShape packed_shape(const std::string& fn, const Shape& s, std::vector<int64_t> offsets);

/// The state path's shape: as is without cu_seqlens (`offsets` empty); with them, (1, H, T, .)
/// tensors holding offsets.size() - 1 sequences, one state each (Shape::offsets), the offsets
/// checked here (0 first, T last, nondecreasing).
Shape sequences_shape(const std::string& fn, Shape s, const std::vector<int64_t>& offsets) {
  if (offsets.empty()) return s;
  const PackedShape p = packed_shape(fn, s, offsets);  // batch 1, as many keys as queries
  bool ok = p.offsets.size() >= 2 && p.offsets.front() == 0 && p.offsets.back() == p.rows;
  for (std::size_t i = 1; ok && i < p.offsets.size(); ++i) ok = p.offsets[i - 1] <= p.offsets[i];
  if (!ok)
    fail(fn, "cu_seqlens must hold N + 1 >= 2 nondecreasing offsets from 0 to the " +
                 std::to_string(p.rows) + " tokens of q");
  s.batch = static_cast<Index>(p.offsets.size()) - 1;
  s.offsets = p.offsets;
  return s;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, SavedBox, bool> gma_forward_state_py(
    at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor mean, at::Tensor var_raw,
    at::Tensor prior_logit, at::Tensor S0, at::Tensor z0, double eps, double var_floor,
    bool check_finite, const SavedBox* prepared, bool save,
    const std::vector<int64_t>& offsets) {
  const std::string fn = "mixattn.gma_attention";
  const GmaArgs a = gma_args(fn, q, k, v, mean, var_raw, prior_logit, true, eps, var_floor,
                             check_finite);
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
                                              const SavedBox& saved, double eps,
                                              double var_floor, bool check_finite,
                                              const std::vector<int64_t>& offsets) {
  const std::string fn = "mixattn.gma_attention (backward)";
  const GmaArgs a = gma_args(fn, q, k, v, mean, var_raw, prior_logit, true, eps, var_floor,
                             check_finite);
  const Shape s = sequences_shape(fn, a.shape, offsets);
  const int64_t K = a.config.components;
  grad_out = checked_grad_out(fn, grad_out, s, a.q);
  grad_S = checked_state(fn, grad_S, "grad of final_state[0] (S)",
                         {s.batch, s.heads, K, s.value_dim});
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
at::Tensor to_packed(const at::Tensor& t) { return t.select(0, 0).transpose(0, 1).contiguous(); }

/// (T, H, d) -> (1, H, T, d), a view.
at::Tensor from_packed(const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); }

/// The packed call of (1, H, T, .) tensors already checked against each other (q and k with the
/// same T); the library checks the offsets.
PackedShape packed_shape(const std::string& fn, const Shape& s, std::vector<int64_t> offsets) {
  if (s.batch != 1 || s.queries != s.keys)
    fail(fn, "cu_seqlens packs the sequences along the tokens of one batch entry: q and k must "
             "be (1, H, T, .) with the same T, got batch " + std::to_string(s.batch) + ", " +
             std::to_string(s.queries) + " queries and " + std::to_string(s.keys) + " keys");
  PackedShape p;
  p.heads = s.heads;
  p.rows = s.queries;
  p.key_dim = s.key_dim;
  p.value_dim = s.value_dim;
  p.offsets.assign(offsets.begin(), offsets.end());
  return p;
}

template <class T>
GmaInputs<T> gma_packed_inputs(const GmaArgs& a, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v) {
  return {q.data_ptr<T>(),      k.data_ptr<T>(),         v.data_ptr<T>(),
          a.mean.data_ptr<T>(), a.var_raw.data_ptr<T>(), a.prior_logit.data_ptr<T>()};
}

std::tuple<at::Tensor, SavedBox> gma_forward_packed_py(
    at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor mean, at::Tensor var_raw,
    at::Tensor prior_logit, std::vector<int64_t> offsets, bool causal, double eps,
    double var_floor, bool check_finite) {
  const std::string fn = "mixattn.gma_attention";
  const GmaArgs a = gma_args(fn, q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor,
                             check_finite);
  const PackedShape s = packed_shape(fn, a.shape, std::move(offsets));
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
                                               const SavedBox& saved,
                                               std::vector<int64_t> offsets, bool causal,
                                               double eps, double var_floor, bool check_finite) {
  const std::string fn = "mixattn.gma_attention (backward)";
  const GmaArgs a = gma_args(fn, q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor,
                             check_finite);
  const PackedShape s = packed_shape(fn, a.shape, std::move(offsets));
  grad_out = to_packed(checked_grad_out(fn, grad_out, a.shape, a.q));
  const SavedPtr& rec = unbox(saved, "gma-packed", a.q, fn);
  const at::Tensor pq = to_packed(a.q), pk = to_packed(a.k), pv = to_packed(a.v);
  auto dq = at::empty_like(pq), dk = at::empty_like(pk), dv = at::empty_like(pv);
  auto dmean = at::empty_like(a.mean), dvar = at::empty_like(a.var_raw);
  auto dprior = at::empty_like(a.prior_logit);
  dispatch(a.q, [&](auto t) {
    using T = decltype(t);
    gma_backward_packed<T>(s, a.config, gma_packed_inputs<T>(a, pq, pk, pv),
                           grad_out.data_ptr<T>(), rec, dq.data_ptr<T>(), dk.data_ptr<T>(),
                           dv.data_ptr<T>(), dmean.data_ptr<T>(), dvar.data_ptr<T>(),
                           dprior.data_ptr<T>());
  });
  return {from_packed(dq), from_packed(dk), from_packed(dv), dmean, dvar, dprior};
}

// --- OVQ ---------------------------------------------------------------------------------------

OvqConfig ovq_config(int64_t block, int64_t max_centroids, const std::string& growth,
                     double growth_alpha, const std::string& seeding,
                     const std::string& assignment, bool count_bias,
                     bool grad_through_dictionary, double norm_eps, bool check_finite) {
  const std::string fn = "mixattn.ovq_attention";
  OvqConfig c;
  c.block = block;
  c.max_centroids = max_centroids;
  if (growth != "plateau" && growth != "linear")
    fail(fn, "growth is '" + growth + "'; it must be 'plateau' or 'linear'");
  c.linear_growth = growth == "linear";
  c.growth_alpha = growth_alpha;
  if (seeding != "greedy_dispersion" && seeding != "one_shot")
    fail(fn, "seeding is '" + seeding + "'; it must be 'greedy_dispersion' or 'one_shot'");
  c.one_shot_seeding = seeding == "one_shot";
  if (assignment != "all_centroids" && assignment != "existing_only")
    fail(fn, "assignment is '" + assignment + "'; it must be 'all_centroids' or 'existing_only'");
  c.existing_only = assignment == "existing_only";
  c.count_bias = count_bias;
  c.grad_through_dictionary = grad_through_dictionary;
  c.norm_eps = norm_eps;
  c.check_finite = check_finite;
  return c;
}

Shape ovq_shape(const std::string& fn, at::Tensor& q, at::Tensor& k, at::Tensor& v,
                at::Tensor& beta) {
  const Shape s = attention_shape(fn, q, k, v);
  if (s.keys != s.queries)
    fail(fn, "OVQ is causal self-attention: k has shape " + shape_of(k) +
                 " but q has " + shape_of(q) + " (as many tokens needed)");
  beta = checked(beta, fn, "beta", 1, q);
  expect_size(fn, beta, "beta", 0, s.heads, "heads of q");
  return s;
}

/// The dictionaries a forward ended with, one library ovq::State per (b, h): opaque to Python,
/// continued by the next call that is given it (which copies it, leaving it as it was).
struct OvqStateBox {
  std::string kind;  // scalar type it holds, e.g. "ovq-state/Double"
  OvqStates states;
};

std::tuple<at::Tensor, SavedBox, OvqStateBox> ovq_forward_py(
    at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor beta, const OvqConfig& c,
    const OvqStateBox* start, bool save, const std::vector<int64_t>& offsets) {
  const std::string fn = "mixattn.ovq_attention";
  const Shape s = sequences_shape(fn, ovq_shape(fn, q, k, v, beta), offsets);
  const std::string kind = "ovq-state/" + std::string(c10::toString(q.scalar_type()));
  if (start != nullptr) {
    const Shape& was = start->states.shape;
    if (start->kind != kind || !start->states.states)
      fail(fn, "initial_state holds " + start->kind + " dictionaries but q is " +
                   std::string(c10::toString(q.scalar_type())));
    if (was.batch != s.batch || was.heads != s.heads || was.key_dim != s.key_dim ||
        was.value_dim != s.value_dim)
      fail(fn, "initial_state was made for (batch or sequences, heads, key dim, value dim) = (" +
                   std::to_string(was.batch) + ", " + std::to_string(was.heads) + ", " +
                   std::to_string(was.key_dim) + ", " + std::to_string(was.value_dim) +
                   ") but q has shape " + shape_of(q) + " and v has " + shape_of(v) +
                   (offsets.empty() ? std::string()
                                    : " with " + std::to_string(s.batch) + " sequences"));
  }
  at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, q.options());
  OvqStateBox end{kind, {}};
  SavedPtr rec = dispatch(q, [&](auto t) {
    using T = decltype(t);
    return ovq_forward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                          beta.data_ptr<T>(), out.data_ptr<T>(),
                          start != nullptr ? &start->states : nullptr, &end.states, save);
  });
  return {out, box("ovq", q, std::move(rec)), std::move(end)};
}

std::vector<at::Tensor> ovq_backward_py(at::Tensor q, at::Tensor k, at::Tensor v,
                                           at::Tensor beta, at::Tensor grad_out,
                                           const SavedBox& saved, const OvqConfig& c,
                                           const std::vector<int64_t>& offsets) {
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

Shape flash_shape(const std::string& fn, at::Tensor& q, at::Tensor& k, at::Tensor& v,
                  bool causal) {
  const Shape s = attention_shape(fn, q, k, v);
  if (causal && s.queries != s.keys)
    fail(fn, "causal needs as many queries as keys, but q has shape " + shape_of(q) +
                 " and k has " + shape_of(k));
  return s;
}

std::tuple<at::Tensor, SavedBox> flash_forward_py(at::Tensor q, at::Tensor k,
                                                     at::Tensor v, bool causal, double scale,
                                                     bool check_finite, bool save) {
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
                                             at::Tensor grad_out, const SavedBox& saved,
                                             bool causal, double scale, bool check_finite) {
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

std::tuple<at::Tensor, SavedBox> flash_forward_packed_py(at::Tensor q, at::Tensor k,
                                                        at::Tensor v,
                                                        std::vector<int64_t> offsets,
                                                        bool causal, double scale,
                                                        bool check_finite) {
  const std::string fn = "mixattn.flash_attention";
  const PackedShape s = packed_shape(fn, flash_shape(fn, q, k, v, causal), std::move(offsets));
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
  const PackedShape s = packed_shape(fn, full, std::move(offsets));
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
      .def_property_readonly("batch", [](const mt::OvqStateBox& b) { return b.states.shape.batch; })
      .def_property_readonly("heads", [](const mt::OvqStateBox& b) { return b.states.shape.heads; })
      .def_property_readonly("kind", [](const mt::OvqStateBox& b) { return b.kind; });
  py::class_<mt::OvqConfig>(m, "OvqConfig")
      .def(py::init(&mt::ovq_config), py::arg("block"), py::arg("max_centroids"),
           py::arg("growth"), py::arg("growth_alpha"), py::arg("seeding"), py::arg("assignment"), py::arg("count_bias"),
           py::arg("grad_through_dictionary"), py::arg("norm_eps"), py::arg("check_finite"));
  // The kernels release the GIL: other Python threads (DDP's reducer, data loaders) run meanwhile.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("gma_forward", &mt::gma_forward_py, nogil);
  m.def("gma_backward", &mt::gma_backward_py, nogil);
  m.def("gma_prepare", &mt::gma_prepare_py, nogil);
  m.def("gma_forward_state", &mt::gma_forward_state_py, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("mean"), py::arg("var_raw"), py::arg("prior_logit"), py::arg("S0"),
        py::arg("z0"), py::arg("eps"), py::arg("var_floor"), py::arg("check_finite"),
        py::arg("prepared") = nullptr, py::arg("save") = true,
        py::arg("offsets") = std::vector<int64_t>{}, nogil);
  m.def("gma_backward_state", &mt::gma_backward_state_py, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("mean"), py::arg("var_raw"), py::arg("prior_logit"),
        py::arg("grad_out"), py::arg("grad_S"), py::arg("grad_z"), py::arg("saved"),
        py::arg("eps"), py::arg("var_floor"), py::arg("check_finite"),
        py::arg("offsets") = std::vector<int64_t>{}, nogil);
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
}
