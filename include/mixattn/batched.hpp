// mixattn/batched.hpp — multi-head entry points: H independent heads side by side in columns,
// each with its own routing mixture, run in parallel over heads (mixattn/parallel.hpp).
//
// Layout (no copies of the inputs): head h reads columns [h r, (h+1) r) of q and k and
// [h d_v, (h+1) d_v) of v, and writes the same column block of the output. A column block of a
// row-major matrix binds to ConstMatrixRef without a copy. Several sequences (a batch of B) are
// B calls, or B·H heads stacked the same way when they share N.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/gma.hpp"
#include "mixattn/parallel.hpp"

#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {
template <class T>
void check_gma_heads(const char* fn, const std::vector<gma::Mixture<T>>& mixtures, Index qc,
                     Index kc, Index vc, int threads) {
  require(!mixtures.empty(), fn, "mixtures is empty (need one mixture per head)");
  const Index heads = static_cast<Index>(mixtures.size());
  const Index r = mixtures.front().mean.cols();
  for (Index h = 1; h < heads; ++h)
    require(mixtures[static_cast<std::size_t>(h)].mean.cols() == r, fn, "mixtures[", h,
            "] has dimension ", mixtures[static_cast<std::size_t>(h)].mean.cols(),
            " but mixtures[0] has ", r);
  require(qc == heads * r, fn, "q has ", qc, " columns but ", heads, " heads of dimension ", r,
          " need ", heads * r);
  require(kc == heads * r, fn, "k has ", kc, " columns but ", heads, " heads of dimension ", r,
          " need ", heads * r);
  require(vc % heads == 0, fn, "v has ", vc, " columns, not a multiple of ", heads, " heads");
  require(threads >= 0, fn, "threads must be >= 0, got ", threads);
}
}  // namespace detail

namespace gma {

/// What forward_heads keeps for backward_heads: one Saved per head.
template <class T>
struct HeadsSaved {
  std::vector<Saved<T>> heads;
};

/// Gradients of forward_heads: dq (N x H r), dk (M x H r), dv (M x H d_v), one MixtureGrad per
/// head.
template <class T>
struct HeadsGrad {
  Matrix<T> q, k, v;
  std::vector<MixtureGrad<T>> mixtures;
};

/// Multi-head GMA forward. mixtures: H mixtures of dimension r; q: N x (H r), k: M x (H r),
/// v: M x (H d_v). Returns N x (H d_v). threads: 0 = all cores, 1 = the calling thread only.
template <class T>
Matrix<T> forward_heads(const std::vector<Mixture<T>>& mixtures, const ConstMatrixArg<T>& q,
                        const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                        const Options& opt = {}, int threads = 1, HeadsSaved<T>* saved = nullptr) {
  mixattn::detail::check_gma_heads("mixattn::gma::forward_heads", mixtures, q.cols(), k.cols(),
                                   v.cols(), threads);
  const Index heads = static_cast<Index>(mixtures.size());
  const Index r = q.cols() / heads, d_v = v.cols() / heads;
  Matrix<T> out(q.rows(), v.cols());
  std::vector<Saved<T>> local(saved ? static_cast<std::size_t>(heads) : 0);
  parallel_for(heads, threads, [&](Index h) {
    const std::size_t hs = static_cast<std::size_t>(h);
    out.middleCols(h * d_v, d_v) =
        forward(mixtures[hs], q.middleCols(h * r, r), k.middleCols(h * r, r),
                v.middleCols(h * d_v, d_v), opt, saved ? &local[hs] : nullptr);
  });
  if (saved) saved->heads = std::move(local);
  return out;
}

/// Multi-head GMA backward; grad_out: N x (H d_v); saved from forward_heads with the same inputs.
template <class T>
HeadsGrad<T> backward_heads(const std::vector<Mixture<T>>& mixtures, const ConstMatrixArg<T>& q,
                            const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                            const ConstMatrixArg<T>& grad_out, const HeadsSaved<T>& saved,
                            const Options& opt = {}, int threads = 1) {
  const char* fn = "mixattn::gma::backward_heads";
  mixattn::detail::check_gma_heads(fn, mixtures, q.cols(), k.cols(), v.cols(), threads);
  const Index heads = static_cast<Index>(mixtures.size());
  mixattn::detail::require(static_cast<Index>(saved.heads.size()) == heads, fn, "saved has ",
                           saved.heads.size(), " heads but mixtures has ", heads);
  mixattn::detail::require(grad_out.rows() == q.rows() && grad_out.cols() == v.cols(), fn,
                           "grad_out is ", mixattn::detail::shape_str(grad_out), " but expected ",
                           q.rows(), " x ", v.cols());
  const Index r = q.cols() / heads, d_v = v.cols() / heads;
  HeadsGrad<T> g;
  g.q.resize(q.rows(), q.cols());
  g.k.resize(k.rows(), k.cols());
  g.v.resize(v.rows(), v.cols());
  g.mixtures.resize(static_cast<std::size_t>(heads));
  parallel_for(heads, threads, [&](Index h) {
    const std::size_t hs = static_cast<std::size_t>(h);
    Grad<T> gh = backward(mixtures[hs], q.middleCols(h * r, r), k.middleCols(h * r, r),
                          v.middleCols(h * d_v, d_v), grad_out.middleCols(h * d_v, d_v),
                          saved.heads[hs], opt);
    g.q.middleCols(h * r, r) = gh.q;
    g.k.middleCols(h * r, r) = gh.k;
    g.v.middleCols(h * d_v, d_v) = gh.v;
    g.mixtures[hs] = std::move(gh.mixture);
  });
  return g;
}

}  // namespace gma
MIXATTN_END_NAMESPACE
