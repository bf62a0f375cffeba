// mixattn/gma.hpp — Gaussian Mixture Attention (SPEC.md section 1), forward and backward.
//
// Queries and keys are routed through one shared diagonal Gaussian mixture of K components;
// the attention is Gamma_Q Gamma_K^T, a rank-K factorisation that is never formed:
//   bidirectional  O = (Gamma_Q (Gamma_K^T V)) / (Gamma_Q (Gamma_K^T 1) + eps)     O((N+M) K)
//   causal         the same with prefix sums, chunk-wise (SPEC 1.4)
// Thread safety: every function is reentrant and may run concurrently on different threads.
// forward without `saved` reuses two per-thread (thread_local) N x K scratch buffers, which stay
// allocated for the thread's lifetime. GEMMs use the threads Eigen is configured with.
//
// Every entry point has a defaulted template parameter Arch (the SIMD instruction set the
// translation unit is compiled for, detail/simd.hpp); callers never write it.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/gma_scan.hpp"
#include "mixattn/detail/log_density.hpp"
#include "mixattn/detail/simd.hpp"

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

namespace mixattn::gma {

/// One head's routing mixture (SPEC 1.1): mean K x r, var_raw K x r, prior_logit K.
/// variance = softplus(var_raw) + var_floor, log pi = log_softmax(prior_logit).
template <class T>
struct Mixture {
  Matrix<T> mean;         // K x r
  Matrix<T> var_raw;      // K x r
  Vector<T> prior_logit;  // K
  T var_floor = T(1e-4);

  Index components() const { return mean.rows(); }
  Index dim() const { return mean.cols(); }

  /// Default initialisation (SPEC 1.1): mean ~ N(0, 1) * mean_scale, var_raw = 0, prior_logit
  /// = 0. Reproducible for a given seed on every platform (mt19937_64 and Box-Muller, no
  /// implementation-defined distribution).
  static Mixture random(Index components, Index dim, std::uint64_t seed, T mean_scale = T(1));
};

/// Gradients of the mixture's parameters; same shapes as Mixture.
template <class T>
struct MixtureGrad {
  Matrix<T> mean;         // K x r
  Matrix<T> var_raw;      // K x r
  Vector<T> prior_logit;  // K
};

struct Options {
  bool causal = false;  // SPEC 1.4 (requires q.rows() == k.rows())
  double eps = 1e-6;    // read-out denominator floor, > 0
  bool check_finite = true;
  /// Causal chunk length C (SPEC 1.4); 0 picks the measured default (32). Does not change the
  /// result beyond rounding.
  Index chunk = 0;
};

/// What forward keeps for backward: O((N + M) K + N d_v), never O(N M).
template <class T>
struct Saved {
  Matrix<T> gamma_q;  // N x K
  Matrix<T> gamma_k;  // M x K
  Vector<T> den;      // N, gamma_q,i . z_i + eps
  Matrix<T> out;      // N x d_v, the forward output (h_i = -(dO_i . O_i) / den_i needs it)
  Matrix<T> vt;       // K x d_v, Gamma_K^T V (bidirectional only)
  Vector<T> z;        // K, Gamma_K^T 1 (bidirectional only)
  bool causal = false;
  double eps = 0;
  Index chunk = 0;
  double fingerprint[4] = {0, 0, 0, 0};  // content sums of q, k, v, mixture
  bool valid = false;
};

template <class T>
struct Grad {
  Matrix<T> q, k, v;  // N x r, M x r, M x d_v
  MixtureGrad<T> mixture;
};

}  // namespace mixattn::gma

namespace mixattn::detail {

/// Deterministic order-fixed sum (8 interleaved lanes, so it vectorises without reassociation):
/// the same input gives the same bits whatever its alignment.
template <class Derived>
double content_sum(const Eigen::DenseBase<Derived>& x) {
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const Index rows = x.rows(), cols = x.cols();
  for (Index i = 0; i < rows; ++i) {
    Index j = 0;
    for (; j + 8 <= cols; j += 8)
      for (int l = 0; l < 8; ++l) lanes[l] += static_cast<double>(x.derived().coeff(i, j + l));
    for (; j < cols; ++j) lanes[0] += static_cast<double>(x.derived().coeff(i, j));
  }
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

template <class T>
double mixture_sum(const gma::Mixture<T>& mix) {
  return content_sum(mix.mean) + 2 * content_sum(mix.var_raw) + 3 * content_sum(mix.prior_logit) +
         static_cast<double>(mix.var_floor);
}

/// require_finite with a vectorised fast path: x * 0 is 0 for finite x and NaN otherwise, so one
/// SIMD sum decides; the slow locating scan runs only when something is wrong.
template <class Derived>
void gma_require_finite(const Eigen::DenseBase<Derived>& x, const char* fn, const char* arg) {
  using S = typename Derived::Scalar;
  if (x.size() == 0) return;
  const S probe = (x.derived().array() * S(0)).sum();
  if (probe == S(0)) return;
  require_finite(x, fn, arg);
}

template <class T>
void gma_check_mixture(const gma::Mixture<T>& mix, const char* fn, bool check_finite) {
  const Index K = mix.mean.rows(), r = mix.mean.cols();
  require(K > 0 && r > 0, fn, "mixture has ", K, " components of dimension ", r,
          " (mean is ", shape_str(mix.mean), "); both must be positive");
  require(mix.var_raw.rows() == K && mix.var_raw.cols() == r, fn, "mixture.var_raw is ",
          shape_str(mix.var_raw), " but mixture.mean is ", shape_str(mix.mean));
  require(mix.prior_logit.size() == K, fn, "mixture.prior_logit has ", mix.prior_logit.size(),
          " entries but mixture.mean has ", K, " components");
  require(std::isfinite(static_cast<double>(mix.var_floor)) && mix.var_floor > 0, fn,
          "mixture.var_floor is ", mix.var_floor, "; it must be positive and finite");
  if (check_finite) {
    gma_require_finite(mix.mean, fn, "mixture.mean");
    gma_require_finite(mix.var_raw, fn, "mixture.var_raw");
    gma_require_finite(mix.prior_logit, fn, "mixture.prior_logit");
  }
}

template <class T>
void gma_check_inputs(const char* fn, const gma::Mixture<T>& mix, const ConstMatrixRef<T>& q,
                      const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                      const gma::Options& opt) {
  gma_check_mixture(mix, fn, opt.check_finite);
  const Index r = mix.mean.cols();
  require(q.cols() == r, fn, "q is ", shape_str(q), " but the mixture has dimension ", r);
  require(k.cols() == r, fn, "k is ", shape_str(k), " but the mixture has dimension ", r);
  require(v.rows() == k.rows(), fn, "v has ", v.rows(), " rows but k has ", k.rows());
  require(!opt.causal || q.rows() == k.rows(), fn, "causal needs as many queries as keys, but q has ",
          q.rows(), " rows and k has ", k.rows());
  require(opt.eps > 0 && std::isfinite(opt.eps), fn, "options.eps is ", opt.eps,
          "; it must be positive and finite");
  require(opt.chunk >= 0, fn, "options.chunk is ", opt.chunk, "; it must be >= 0 (0: default)");
  if (opt.check_finite) {
    gma_require_finite(q, fn, "q");
    gma_require_finite(k, fn, "k");
    gma_require_finite(v, fn, "v");
  }
}

/// Per-thread scratch for forward without `saved` (two N x K buffers, kept for the thread's
/// lifetime and grown to the largest call; each thread has its own, so calls stay reentrant).
template <class T>
Matrix<T>& gma_workspace(int slot) {
  thread_local Matrix<T> buffers[2];
  return buffers[slot];
}

inline Index gma_chunk(const gma::Options& opt) {
  return opt.chunk > 0 ? opt.chunk : gma_default_chunk;
}

/// Gamma of the rows of x for a mixture already reduced to its packed constants.
template <class Arch, class T>
Matrix<T> gma_gamma(const PackedDensity<T>& p, const ConstMatrixRef<T>& x) {
  Matrix<T> out(x.rows(), p.components);
  responsibilities_into(Arch{}, p, x.data(), x.outerStride(), x.rows(), out.data(),
                        p.components);
  return out;
}

/// Backward through the softmax and the log-density (SPEC 1.5) for the stacked Q and K paths.
/// The reductions are GEMMs (dS P, dS^T X, dS^T X.X); they run in wide_t<T> on inputs shifted by
/// the mean of the component means, because the expanded form of sum_i dS P (x - mu)^2 cancels
/// catastrophically in float once |mu| / sigma is large (see test_gma_backward, cancellation).
template <class T, class W>
void gma_log_density_backward(const gma::Mixture<T>& mix, const MixtureConstants<W>& c,
                              const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                              const Matrix<T>& gq, const Matrix<T>& dgq, const Matrix<T>& gk,
                              const Matrix<T>& dgk, gma::Grad<T>& grad) {
  const Index N = q.rows(), M = k.rows(), K = mix.mean.rows(), r = mix.mean.cols(), n = N + M;
  const Eigen::Matrix<W, 1, Eigen::Dynamic> centre =
      mix.mean.template cast<W>().colwise().mean();
  Matrix<W> ds(n, K), xx(n, 2 * r);
  // dS = gamma . (dgamma - rowsum(gamma . dgamma)), and [x' | x'.x'] with x' = x - centre.
  auto fill = [&](const Matrix<T>& gamma, const Matrix<T>& dgamma, const ConstMatrixRef<T>& x,
                  Index row0) {
    for (Index i = 0; i < x.rows(); ++i) {
      W dot = 0;
      for (Index kk = 0; kk < K; ++kk) dot += W(gamma(i, kk)) * W(dgamma(i, kk));
      for (Index kk = 0; kk < K; ++kk)
        ds(row0 + i, kk) = W(gamma(i, kk)) * (W(dgamma(i, kk)) - dot);
      for (Index m = 0; m < r; ++m) {
        const W xm = W(x(i, m)) - centre(m);
        xx(row0 + i, m) = xm;
        xx(row0 + i, r + m) = xm * xm;
      }
    }
  };
  fill(gq, dgq, q, 0);
  fill(gk, dgk, k, N);

  const Matrix<W> mu = mix.mean.template cast<W>().rowwise() - centre;  // K x r, shifted
  Matrix<W> pp(K, 2 * r);                                               // [P | P.mu']
  pp.leftCols(r) = c.var.cwiseInverse();
  pp.rightCols(r) = pp.leftCols(r).cwiseProduct(mu);

  // dx_im = -sum_k dS_ik P_km (x'_im - mu'_km) = (dS (P.mu'))_im - x'_im (dS P)_im
  Matrix<W> dsp(n, 2 * r);
  dsp.noalias() = ds * pp;
  Matrix<W> dx = dsp.rightCols(r) - xx.leftCols(r).cwiseProduct(dsp.leftCols(r));
  grad.q = dx.topRows(N).template cast<T>();
  grad.k = dx.bottomRows(M).template cast<T>();

  // T1 = dS^T x', T2 = dS^T x'^2, s = dS^T 1
  Matrix<W> tt(K, 2 * r);
  tt.noalias() = ds.transpose() * xx;
  const Vector<W> s = ds.colwise().sum().transpose();
  const Matrix<W> P = pp.leftCols(r);
  const Matrix<W> t1 = tt.leftCols(r), t2 = tt.rightCols(r);
  // d mu = P (T1 - mu' s);  d var = 1/2 P^2 (T2 - 2 mu' T1 + mu'^2 s) - 1/2 P s
  const Matrix<W> dmu = P.cwiseProduct(t1 - (mu.array().colwise() * s.array()).matrix());
  Matrix<W> r2 = t2 - 2 * mu.cwiseProduct(t1);
  r2 += (mu.array().square().colwise() * s.array()).matrix();
  Matrix<W> dvar = W(0.5) * P.cwiseProduct(P).cwiseProduct(r2);
  dvar -= W(0.5) * (P.array().colwise() * s.array()).matrix();
  // chain rule to the raw parameters: d var_raw = d var . sigmoid(var_raw); softmax for the prior
  grad.mixture.mean = dmu.template cast<T>();
  grad.mixture.var_raw.resize(K, r);
  for (Index kk = 0; kk < K; ++kk)
    for (Index m = 0; m < r; ++m)
      grad.mixture.var_raw(kk, m) =
          static_cast<T>(dvar(kk, m) * sigmoid(static_cast<W>(mix.var_raw(kk, m))));
  const W total = s.sum();
  grad.mixture.prior_logit = (s.array() - c.log_pi.array().exp() * total).template cast<T>();
}

}  // namespace mixattn::detail

namespace mixattn::gma {

template <class T>
Mixture<T> Mixture<T>::random(Index components, Index dim, std::uint64_t seed, T mean_scale) {
  detail::require(components > 0 && dim > 0, "mixattn::gma::Mixture::random", "components is ",
                  components, " and dim is ", dim, "; both must be positive");
  std::mt19937_64 rng(seed);
  const double two_pi = 6.283185307179586476925286766559;
  auto uniform = [&rng] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
  Mixture m;
  m.mean.resize(components, dim);
  for (Index i = 0; i < m.mean.size(); i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(uniform())), angle = two_pi * uniform();
    m.mean.data()[i] = static_cast<T>(radius * std::cos(angle) * static_cast<double>(mean_scale));
    if (i + 1 < m.mean.size())
      m.mean.data()[i + 1] =
          static_cast<T>(radius * std::sin(angle) * static_cast<double>(mean_scale));
  }
  m.var_raw = Matrix<T>::Zero(components, dim);
  m.prior_logit = Vector<T>::Zero(components);
  return m;
}

/// Responsibilities Gamma (SPEC 1.2) of the rows of x: N x K, every row on the simplex.
/// mix: K components of dimension r; x: N x r, row-major.
template <class T, class Arch = detail::simd_arch>
Matrix<T> responsibilities(const Mixture<T>& mix, const ConstMatrixRef<T>& x,
                           bool check_finite = true) {
  static constexpr const char* fn = "mixattn::gma::responsibilities";
  detail::gma_check_mixture(mix, fn, check_finite);
  detail::require(x.cols() == mix.dim(), fn, "x is ", detail::shape_str(x),
                  " but the mixture has dimension ", mix.dim());
  if (check_finite) detail::gma_require_finite(x, fn, "x");
  using W = detail::wide_t<T>;
  const detail::MixtureConstants<W> c =
      detail::mixture_constants<W>(mix.mean, mix.var_raw, mix.prior_logit, mix.var_floor);
  const detail::PackedDensity<T> p = detail::pack_density<Arch, T>(mix.mean, c);
  return detail::gma_gamma<Arch, T>(p, x);
}

/// GMA forward (SPEC 1.3 bidirectional, 1.4 causal).
/// q: N x r, k: M x r, v: M x d_v (M == N when causal). Returns N x d_v.
/// If `saved` is given it receives what backward needs (O((N + M) K + N d_v)).
template <class T, class Arch = detail::simd_arch>
Matrix<T> forward(const Mixture<T>& mix, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                  const ConstMatrixRef<T>& v, const Options& opt = {}, Saved<T>* saved = nullptr) {
  static constexpr const char* fn = "mixattn::gma::forward";
  detail::gma_check_inputs(fn, mix, q, k, v, opt);
  using W = detail::wide_t<T>;
  const Index N = q.rows(), K = mix.components(), dv = v.cols();
  const T eps = static_cast<T>(opt.eps);
  const detail::MixtureConstants<W> c =
      detail::mixture_constants<W>(mix.mean, mix.var_raw, mix.prior_logit, mix.var_floor);
  const detail::PackedDensity<T> p = detail::pack_density<Arch, T>(mix.mean, c);
  // Without `saved` the responsibilities are scratch: reuse this thread's buffers so that a
  // steady stream of calls neither page-faults fresh memory nor returns it to the OS each time.
  Matrix<T> own_q, own_k;
  Matrix<T>& gq = saved ? own_q : detail::gma_workspace<T>(0);
  Matrix<T>& gk = saved ? own_k : detail::gma_workspace<T>(1);
  gq.resize(N, K);
  gk.resize(k.rows(), K);
  detail::responsibilities_into(Arch{}, p, q.data(), q.outerStride(), N, gq.data(), K);
  detail::responsibilities_into(Arch{}, p, k.data(), k.outerStride(), k.rows(), gk.data(), K);
  Matrix<T> out(N, dv);
  Vector<T> den(N);
  Matrix<T> vt;
  Vector<T> z;
  if (opt.causal) {
    detail::gma_causal_forward<T>(gq, gk, v, eps, detail::gma_chunk(opt), out, den);
  } else {
    // write: Vt = Gamma_K^T V, Z = Gamma_K^T 1; read: numerators by GEMM, denominators by GEMV
    // (a GEMV costs less than copying V into [V | 1] for the ones-column trick).
    vt.resize(K, dv);
    vt.noalias() = gk.transpose() * v;
    z.resize(K);
    z.noalias() = gk.transpose() * Vector<T>::Ones(gk.rows());
    out.noalias() = gq * vt;
    den.noalias() = gq * z;
    den.array() += eps;
    out.array().colwise() /= den.array();
  }
  if (saved) {
    saved->gamma_q = std::move(gq);
    saved->gamma_k = std::move(gk);
    saved->den = std::move(den);
    saved->out = out;
    saved->vt = std::move(vt);
    saved->z = std::move(z);
    saved->causal = opt.causal;
    saved->eps = opt.eps;
    saved->chunk = detail::gma_chunk(opt);
    saved->fingerprint[0] = detail::content_sum(q);
    saved->fingerprint[1] = detail::content_sum(k);
    saved->fingerprint[2] = detail::content_sum(v);
    saved->fingerprint[3] = detail::mixture_sum(mix);
    saved->valid = true;
  }
  return out;
}

/// GMA backward (SPEC 1.5): gradients of sum(grad_out . forward(mix, q, k, v)) with respect to
/// q (N x r), k (M x r), v (M x d_v) and the mixture's mean, var_raw, prior_logit.
/// grad_out: N x d_v; saved: filled by forward with the same inputs and options.
template <class T, class Arch = detail::simd_arch>
Grad<T> backward(const Mixture<T>& mix, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                 const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& grad_out,
                 const Saved<T>& saved, const Options& opt = {}) {
  static constexpr const char* fn = "mixattn::gma::backward";
  detail::gma_check_inputs(fn, mix, q, k, v, opt);
  const Index N = q.rows(), M = k.rows(), K = mix.components(), dv = v.cols();
  detail::require(grad_out.rows() == N && grad_out.cols() == dv, fn, "grad_out is ",
                  detail::shape_str(grad_out), " but the output is ", N, " x ", dv);
  if (opt.check_finite) detail::gma_require_finite(grad_out, fn, "grad_out");
  detail::require(saved.valid, fn, "saved was not filled by forward");
  detail::require(saved.gamma_q.rows() == N && saved.gamma_q.cols() == K &&
                      saved.gamma_k.rows() == M && saved.gamma_k.cols() == K &&
                      saved.den.size() == N && saved.out.rows() == N && saved.out.cols() == dv,
                  fn, "saved is for N = ", saved.gamma_q.rows(), ", M = ", saved.gamma_k.rows(),
                  ", K = ", saved.gamma_q.cols(), ", d_v = ", saved.out.cols(), " but the inputs have N = ",
                  N, ", M = ", M, ", K = ", K, ", d_v = ", dv);
  detail::require(saved.causal == opt.causal && saved.eps == opt.eps, fn,
                  "saved was made with causal = ", saved.causal, ", eps = ", saved.eps,
                  " but options have causal = ", opt.causal, ", eps = ", opt.eps);
  detail::require(saved.fingerprint[0] == detail::content_sum(q) &&
                      saved.fingerprint[1] == detail::content_sum(k) &&
                      saved.fingerprint[2] == detail::content_sum(v) &&
                      saved.fingerprint[3] == detail::mixture_sum(mix),
                  fn, "saved was made from different q, k, v or mixture values");
  using W = detail::wide_t<T>;

  // g_i = dO_i / den_i, h_i = -(dO_i . O_i) / den_i
  const Vector<T> inv_den = saved.den.cwiseInverse();
  Matrix<T> g = grad_out;
  g.array().colwise() *= inv_den.array();
  const Vector<T> h =
      -(grad_out.cwiseProduct(saved.out).rowwise().sum().array() * inv_den.array()).matrix();

  Grad<T> grad;
  Matrix<T> dgq(N, K), dgk(M, K);
  grad.v.resize(M, dv);
  if (opt.causal) {
    detail::gma_causal_backward<T>(saved.gamma_q, saved.gamma_k, v, g, h, saved.chunk, dgq, dgk,
                                   grad.v);
  } else {
    // dGamma_Q = g Vt^T + h Z^T, dVt = Gamma_Q^T g, dZ = Gamma_Q^T h,
    // dGamma_K = V dVt^T + 1 dZ^T, dV = Gamma_K dVt
    dgq.noalias() = g * saved.vt.transpose();
    dgq.noalias() += h * saved.z.transpose();
    Matrix<T> dvt(K, dv);
    dvt.noalias() = saved.gamma_q.transpose() * g;
    Vector<T> dz(K);
    dz.noalias() = saved.gamma_q.transpose() * h;
    dgk.noalias() = v * dvt.transpose();
    dgk.rowwise() += dz.transpose();
    grad.v.noalias() = saved.gamma_k * dvt;
  }
  const detail::MixtureConstants<W> c =
      detail::mixture_constants<W>(mix.mean, mix.var_raw, mix.prior_logit, mix.var_floor);
  detail::gma_log_density_backward<T, W>(mix, c, q, k, saved.gamma_q, dgq, saved.gamma_k, dgk,
                                         grad);
  return grad;
}

}  // namespace mixattn::gma
