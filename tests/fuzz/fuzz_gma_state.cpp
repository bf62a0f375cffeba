// libFuzzer target: GMA's continued causal state (SPEC 1.4 pieces, 1.5 backward across pieces).
// Decodes a mixture (K <= 6, r <= 8), options (eps, chunk, check_finite), a causal sequence
// (<= 48 tokens, NaN/Inf/huge/tiny/zero/duplicate rows) cut into up to 5 pieces (empty ones
// included), the overload (Mixture or Prepared, value or _into) and a mismatch to inject. Every
// call is held to the oracle in fuzz_common.hpp, and:
//   - a forward that throws leaves the State bitwise unchanged;
//   - for moderate inputs the pieces' outputs equal one call over the whole sequence (the pieces
//     change only where the chunked scan restarts: rounding, as a chunk length does);
//   - the pieces' backwards run in reverse, each fed its successor's grad.state, give finite
//     gradients, and in double equal one call's backward up to rounding of the terms each
//     gradient entry sums (term_magnitudes);
//   - a state of another shape, a negative tokens_seen, options.causal false, a NaN in the state,
//     a grad_state_out of another state or shape, or one given to a record of a forward without a
//     State are refused with the documented exception.
#include <mixattn/gma.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
namespace gma = mixattn::gma;
namespace fz = mixattn::fuzz;

using fz::max_abs;

template <class T>
bool same_state(const gma::State<T>& a, const gma::State<T>& b) {
  return fz::same_bits(a.S, b.S) && fz::same_bits(a.z, b.z) && a.tokens_seen == b.tokens_seen;
}

/// One decoded case: the mixture, the sequence, its cut and what to inject.
template <class T>
struct Case {
  gma::Mixture<T> mix;
  gma::Options opt;
  Matrix<T> q, k, v, dout;
  std::vector<Index> cuts;
  fz::Expect ex;  // of the whole sequence
  fz::Flags mix_flags, grad_flags;
  bool prepared = false, into = false;
  std::uint8_t mismatch = 0;
  Index n() const { return q.rows(); }
  Index dv() const { return v.cols(); }
};

template <class T>
Case<T> decode(fz::Bytes& in) {
  Case<T> c;
  const Index kc = in.range(1, 6), r = in.range(1, 8), dv = in.range(1, 8), n = in.range(0, 48);
  c.opt.causal = true;
  static constexpr double eps_menu[] = {1e-6, 1e-6, 1e-3, 1, 1e-12};
  c.opt.eps = in.pick(eps_menu);
  static constexpr Index chunk_menu[] = {0, 1, 2, 3, 5, 64};
  c.opt.chunk = in.pick(chunk_menu);
  c.opt.check_finite = in.u8() % 5 != 0;
  c.prepared = in.flag();
  c.into = in.flag();
  c.mismatch = in.u8();
  static constexpr double floor_menu[] = {1e-4, 1e-4, 1, 1e-30};
  c.mix.var_floor = static_cast<T>(in.pick(floor_menu));
  c.ex.check_finite = c.opt.check_finite;
  c.mix.mean = fz::matrix<T>(in, kc, r, c.mix_flags);
  c.mix.var_raw = fz::matrix<T>(in, kc, r, c.mix_flags);
  c.mix.prior_logit = fz::vector<T>(in, kc, c.mix_flags);
  c.ex.flags = c.mix_flags;
  c.q = fz::matrix<T>(in, n, r, c.ex.flags);
  c.k = fz::matrix<T>(in, n, r, c.ex.flags);
  c.v = fz::matrix<T>(in, n, dv, c.ex.flags);
  c.dout = fz::matrix<T>(in, n, dv, c.grad_flags);
  c.cuts = fz::pieces(in, n, 5);
  // As in fuzz_gma: log-densities of about r (|x| + |mu|)^2 / var_floor beyond T's range may be
  // reported as domain_error.
  const double a = c.ex.flags.max_abs, floor_d = static_cast<double>(c.mix.var_floor);
  if (static_cast<double>(r) * 4 * a * a / floor_d > (sizeof(T) == 4 ? 1e30 : 1e290))
    c.ex.flags.extreme = true;
  if (fz::verbose())
    std::cerr << (sizeof(T) == 4 ? "float" : "double") << " K=" << kc << " r=" << r
              << " dv=" << dv << " n=" << n << " eps=" << c.opt.eps << " chunk=" << c.opt.chunk
              << " check_finite=" << c.opt.check_finite << " prepared=" << c.prepared
              << " into=" << c.into << " mismatch=" << int(c.mismatch % 16)
              << " pieces=" << c.cuts.size() << " non_finite=" << c.ex.flags.non_finite
              << " extreme=" << c.ex.flags.extreme << "\n";
  return c;
}

/// The flags of rows [row0, row0 + len) of the given matrices.
template <class T>
fz::Flags rows_flags(std::initializer_list<const Matrix<T>*> ms, Index row0, Index len) {
  fz::Flags f;
  for (const Matrix<T>* m : ms)
    for (Index i = row0; i < row0 + len; ++i)
      for (Index j = 0; j < m->cols(); ++j) fz::classify<T>(static_cast<double>((*m)(i, j)), f);
  return f;
}

/// What one piece's call may do: the whole sequence's check_finite and magnitudes (a state
/// carries earlier pieces' sums, so overflow may be reported where any piece is extreme), and
/// non-finite values where the mixture, this piece's rows or (checks off) a state that took
/// non-finite rows before has them.
template <class T>
fz::Expect piece_expect(const Case<T>& c, std::initializer_list<const Matrix<T>*> ms, Index row0,
                        Index len, bool carried) {
  fz::Expect ex = c.ex;
  ex.flags.non_finite =
      c.mix_flags.non_finite || rows_flags<T>(ms, row0, len).non_finite || carried;
  return ex;
}

/// One piece's forward through the overload the case picked.
template <class T>
Matrix<T> piece_forward(const Case<T>& c, const gma::Prepared<T>* prep, Index row0, Index len,
                        const gma::Options& opt, gma::State<T>& st, gma::Saved<T>* saved) {
  const auto q = c.q.middleRows(row0, len), k = c.k.middleRows(row0, len);
  const auto v = c.v.middleRows(row0, len);
  Matrix<T> out;
  if (prep != nullptr && c.into) gma::forward_into<T>(out, *prep, q, k, v, opt, st, saved);
  if (prep != nullptr && !c.into) out = gma::forward<T>(*prep, q, k, v, opt, st, saved);
  if (prep == nullptr && c.into) gma::forward_into<T>(out, c.mix, q, k, v, opt, st, saved);
  if (prep == nullptr && !c.into) out = gma::forward<T>(c.mix, q, k, v, opt, st, saved);
  return out;
}

/// Forward mismatches (mismatch % 16): 0 a state of K + 1 components, 1 of d_v + 1 columns,
/// 2 a negative tokens_seen, 3 options.causal false, 4 a NaN in state.z. Applied to the first
/// piece, on a copy; the call must be refused and the copy left as it was.
template <class T>
void forward_mismatch(const Case<T>& c, const gma::Prepared<T>* prep) {
  const Index kc = c.mix.components(), dv = c.dv();
  gma::State<T> st = gma::State<T>::empty(kc, dv);
  gma::Options opt = c.opt;
  fz::Expect ex = piece_expect(c, {&c.q, &c.k, &c.v}, 0, c.cuts[0], false);
  switch (c.mismatch % 16) {
    case 0: st = gma::State<T>::empty(kc + 1, dv); ex.invalid = true; break;
    case 1: st = gma::State<T>::empty(kc, dv + 1); ex.invalid = true; break;
    case 2: st.tokens_seen = -1; ex.invalid = true; break;
    case 3: opt.causal = false; ex.invalid = true; break;
    case 4: st.z[0] = std::numeric_limits<double>::quiet_NaN(); ex.flags.non_finite = true; break;
    default: return;
  }
  const gma::State<T> before = st;
  gma::Saved<T> saved;
  const fz::Outcome o =
      fz::run(ex, [&] { piece_forward(c, prep, 0, c.cuts[0], opt, st, &saved); });
  if (o != fz::Outcome::returned)
    MIXATTN_FUZZ_CHECK(same_state(st, before), "a refused forward changed the state");
}

/// The pieces' forwards, in order, from State::empty; false when one threw (the sequence then
/// ends there, and the state must be as that call found it).
template <class T>
bool forward_pieces(const Case<T>& c, const gma::Prepared<T>* prep, Matrix<T>& out,
                    std::vector<gma::Saved<T>>& saved, gma::State<T>& st) {
  st = gma::State<T>::empty(c.mix.components(), c.dv());
  out.resize(c.n(), c.dv());
  saved.assign(c.cuts.size(), gma::Saved<T>());
  Index row0 = 0;
  bool carried = false;  // a non-finite row the state took (checks off)
  for (std::size_t p = 0; p < c.cuts.size(); ++p) {
    const Index len = c.cuts[p];
    const gma::State<T> before = st;
    const fz::Expect ex = piece_expect(c, {&c.q, &c.k, &c.v}, row0, len, carried);
    carried = ex.flags.non_finite;
    Matrix<T> piece;
    const fz::Outcome o =
        fz::run(ex, [&] { piece = piece_forward(c, prep, row0, len, c.opt, st, &saved[p]); });
    if (o != fz::Outcome::returned) {
      MIXATTN_FUZZ_CHECK(same_state(st, before), "a throwing forward changed the state");
      return false;
    }
    fz::check_result(piece, len, c.dv(), ex.must_be_finite(), "piece output");
    MIXATTN_FUZZ_CHECK(st.tokens_seen == before.tokens_seen + len, "tokens_seen not advanced");
    if (ex.must_be_finite())
      MIXATTN_FUZZ_CHECK(st.S.allFinite() && st.z.allFinite(), "non-finite state");
    out.middleRows(row0, len) = piece;
    row0 += len;
  }
  return true;
}

/// Backward mismatches (mismatch % 16): 8 the last piece given a grad_state_out carrying another
/// state's fingerprint, 9 one of the wrong shape, 10 the one-call record given a grad_state_out,
/// 11 a piece given its own grad.state (the gradient of its start, not its end, state).
template <class T>
void backward_mismatch(const Case<T>& c, const std::vector<gma::Saved<T>>& saved,
                       const gma::Saved<T>& one) {
  const std::uint8_t m = c.mismatch % 16;
  if (m < 8 || m > 11 || c.ex.flags.non_finite || c.grad_flags.non_finite) return;
  const Index kc = c.mix.components(), dv = c.dv(), n0 = c.cuts.back(), row0 = c.n() - n0;
  const gma::Saved<T>& last = m == 10 ? one : saved.back();
  const Index rows = m == 10 ? c.n() : n0, first = m == 10 ? 0 : row0;
  gma::StateGrad<T> gs;
  gs.S = Matrix<double>::Zero(kc, m == 9 ? dv + 1 : dv);
  gs.z = Vector<double>::Zero(kc);
  gs.state_fingerprint = last.end_fingerprint ^ 1;
  if (m == 11) {
    const gma::Grad<T> own =
        gma::backward<T>(c.mix, c.q.middleRows(first, rows), c.k.middleRows(first, rows),
                         c.v.middleRows(first, rows), c.dout.middleRows(first, rows), last, c.opt);
    gs = own.state;
    // Refused only when it is another state's gradient (an empty piece starts where it ends).
    if (gs.state_fingerprint == last.end_fingerprint) return;
  }
  if (m == 10 || m == 9) gs.state_fingerprint = 0;
  fz::expect_invalid_naming(
      "grad_state_out",
      [&] {
        gma::backward<T>(c.mix, c.q.middleRows(first, rows), c.k.middleRows(first, rows),
                         c.v.middleRows(first, rows), c.dout.middleRows(first, rows), last, c.opt,
                         &gs);
      },
      "a mismatched grad_state_out was refused without naming it");
}

/// The pieces' backwards in reverse, each fed its successor's grad.state (into one Grad, as the
/// _into form allows, or fresh ones); the gradients summed into `total`.
template <class T>
bool backward_pieces(const Case<T>& c, const std::vector<gma::Saved<T>>& saved,
                     gma::Grad<T>& total, const fz::Expect& bex) {
  const Index kc = c.mix.components(), r = c.q.cols(), dv = c.dv();
  total.q.resize(c.n(), r);
  total.k.resize(c.n(), r);
  total.v.resize(c.n(), dv);
  total.mixture.mean = Matrix<T>::Zero(kc, r);
  total.mixture.var_raw = Matrix<T>::Zero(kc, r);
  total.mixture.prior_logit = Vector<T>::Zero(kc);
  gma::Grad<T> g;
  Index row0 = c.n();
  bool carried = false;  // a non-finite grad_out row a later piece's grad.state took
  for (std::size_t p = c.cuts.size(); p-- > 0;) {
    const Index len = c.cuts[p];
    row0 -= len;
    const bool last = p + 1 == c.cuts.size();
    const gma::StateGrad<T> next = g.state;
    fz::Expect pex = bex;  // q, k, v and the mixture are finite here; grad_out by piece
    pex.flags.non_finite = rows_flags<T>({&c.dout}, row0, len).non_finite || carried;
    carried = pex.flags.non_finite;
    const fz::Outcome o = fz::run(pex, [&] {
      const auto q = c.q.middleRows(row0, len), k = c.k.middleRows(row0, len);
      const auto v = c.v.middleRows(row0, len), d = c.dout.middleRows(row0, len);
      if (c.into)
        gma::backward_into<T>(g, c.mix, q, k, v, d, saved[p], c.opt, last ? nullptr : &g.state);
      else
        g = gma::backward<T>(c.mix, q, k, v, d, saved[p], c.opt, last ? nullptr : &next);
    });
    if (o != fz::Outcome::returned) return false;
    total.q.middleRows(row0, len) = g.q;
    total.k.middleRows(row0, len) = g.k;
    total.v.middleRows(row0, len) = g.v;
    total.mixture.mean += g.mixture.mean;
    total.mixture.var_raw += g.mixture.var_raw;
    total.mixture.prior_logit += g.mixture.prior_logit;
    MIXATTN_FUZZ_CHECK(g.state.S.rows() == kc && g.state.S.cols() == dv && g.state.z.size() == kc,
                       "grad.state of the wrong shape");
  }
  return true;
}

/// For every gradient entry of one backward over the whole causal sequence, the sum of the
/// magnitudes of the terms it is computed from (SPEC 1.4, 1.5, with |x - mu| <= |x| + |mu| for
/// whichever form the kernels expand): the chained backward sums the same terms in another order
/// (the pieces' states), so the two differ by rounding relative to these sums, however much the
/// terms cancel. They do cancel: where the mixture's components are alike and q = k = mean, every
/// gradient but dv is exactly 0 while its terms are of order 1.
///   prefix: S_i = sum_{j<=i} gamma_K,j |v_j|, z_i = sum_{j<=i} gamma_K,j,
///           den_i = gamma_Q,i z_i + eps, |g_i| = |dO_i| / den_i,
///           |h_i| <= |dO_i| . (gamma_Q,i S_i) / den_i^2;
///   suffix: G_j = sum_{i>=j} gamma_Q,i |g_i|, u_j = sum_{i>=j} |h_i| gamma_Q,i;
///   dgamma: D_Q,i = S_i |g_i| + |h_i| z_i, D_K,j = G_j |v_j| + u_j; through the softmax
///           T_ik = gamma_ik (D_ik + gamma_i . D_i) (+ |h_i| eps on the query side, whose kernel
///           uses gamma . dgamma = -h eps); then dx_im, dmean_km: T P_km (|x_im| + |mu_km|),
///           dvar_km: T (P^2 (|x| + |mu|)^2 + P) / 2 times sigmoid(var_raw), dlog pi_k: T, and
///           dprior_k: its sum plus pi_k times the sum over k; dv_j = G_j^T gamma_K,j.
template <class T>
gma::Grad<double> term_magnitudes(const Case<T>& c) {
  const Index n = c.n(), kc = c.mix.components(), r = c.q.cols(), dv = c.dv();
  const Matrix<double> gq = gma::responsibilities<T>(c.mix, c.q).template cast<double>();
  const Matrix<double> gk = gma::responsibilities<T>(c.mix, c.k).template cast<double>();
  const Matrix<double> av = c.v.template cast<double>().cwiseAbs();
  const Matrix<double> ado = c.dout.template cast<double>().cwiseAbs();
  const double eps = c.opt.eps;
  Matrix<double> g(n, dv), dgq(n, kc), dgk(n, kc);
  Vector<double> h(n);
  Matrix<double> S = Matrix<double>::Zero(kc, dv);
  Vector<double> z = Vector<double>::Zero(kc);
  for (Index i = 0; i < n; ++i) {
    S += gk.row(i).transpose() * av.row(i);
    z += gk.row(i).transpose();
    const double den = gq.row(i).dot(z) + eps;
    g.row(i) = ado.row(i) / den;
    h[i] = (gq.row(i) * S).dot(ado.row(i)) / (den * den);
    dgq.row(i) = (S * g.row(i).transpose()).transpose() + h[i] * z.transpose();
  }
  gma::Grad<double> m;
  m.v.resize(n, dv);
  Matrix<double> G = Matrix<double>::Zero(kc, dv);
  Vector<double> u = Vector<double>::Zero(kc);
  for (Index j = n; j-- > 0;) {
    G += gq.row(j).transpose() * g.row(j);
    u += h[j] * gq.row(j).transpose();
    dgk.row(j) = (G * av.row(j).transpose() + u).transpose();
    m.v.row(j) = gk.row(j) * G;
  }
  const auto through_softmax = [&](const Matrix<double>& gamma, const Matrix<double>& d,
                                   bool query) {
    Matrix<double> t(n, kc);
    for (Index i = 0; i < n; ++i)
      t.row(i) = gamma.row(i).cwiseProduct(
          (d.row(i).array() + gamma.row(i).dot(d.row(i)) + (query ? h[i] * eps : 0.0)).matrix());
    return t;
  };
  const Matrix<double> tq = through_softmax(gq, dgq, true), tk = through_softmax(gk, dgk, false);
  const Matrix<double> mean = c.mix.mean.template cast<double>().cwiseAbs();
  const Matrix<double> var_raw = c.mix.var_raw.template cast<double>();
  const Matrix<double> xq = c.q.template cast<double>().cwiseAbs();
  const Matrix<double> xk = c.k.template cast<double>().cwiseAbs();
  m.q = Matrix<double>::Zero(n, r);
  m.k = Matrix<double>::Zero(n, r);
  m.mixture.mean = Matrix<double>::Zero(kc, r);
  m.mixture.var_raw = Matrix<double>::Zero(kc, r);
  // Summed by hand: Eigen's colwise() of a matrix of no rows forms its columns at offsets from a
  // null data pointer (UBSan), and a piece may hold no tokens.
  Vector<double> logpi_terms = Vector<double>::Zero(kc);
  for (Index i = 0; i < n; ++i)
    for (Index a = 0; a < kc; ++a) logpi_terms[a] += tq(i, a) + tk(i, a);
  for (Index a = 0; a < kc; ++a)
    for (Index b = 0; b < r; ++b) {
      const double w = var_raw(a, b);
      const double var = (w > 30 ? w : std::log1p(std::exp(w))) +
                         static_cast<double>(c.mix.var_floor);
      const double p = 1 / var, sig = 1 / (1 + std::exp(-w));
      for (Index i = 0; i < n; ++i) {
        const double dq_ = xq(i, b) + mean(a, b), dk_ = xk(i, b) + mean(a, b);
        m.q(i, b) += tq(i, a) * p * dq_;
        m.k(i, b) += tk(i, a) * p * dk_;
        m.mixture.mean(a, b) += (tq(i, a) * dq_ + tk(i, a) * dk_) * p;
        m.mixture.var_raw(a, b) +=
            (tq(i, a) * (p * p * dq_ * dq_ + p) + tk(i, a) * (p * p * dk_ * dk_ + p)) / 2 * sig;
      }
    }
  Vector<double> alpha = c.mix.prior_logit.template cast<double>();
  alpha = (alpha.array() - alpha.maxCoeff()).exp().matrix();
  const Vector<double> pi = alpha / alpha.sum();
  m.mixture.prior_logit = logpi_terms + pi * logpi_terms.sum();
  return m;
}

/// Whether two gradients agree entry by entry within `rel` of their entries' term magnitudes.
template <class T>
bool grads_close(const gma::Grad<T>& a, const gma::Grad<T>& b, const gma::Grad<double>& terms,
                 double rel) {
  const auto close = [rel](const auto& x, const auto& y, const auto& t) {
    const Matrix<double> d = (x - y).template cast<double>().cwiseAbs();
    return (d.array() <= rel * t.array() + 1e-300).all();
  };
  return close(a.q, b.q, terms.q) && close(a.k, b.k, terms.k) && close(a.v, b.v, terms.v) &&
         close(a.mixture.mean, b.mixture.mean, terms.mixture.mean) &&
         close(a.mixture.var_raw, b.mixture.var_raw, terms.mixture.var_raw) &&
         close(a.mixture.prior_logit, b.mixture.prior_logit, terms.mixture.prior_logit);
}

template <class T>
void run_case(fz::Bytes& in) {
  const bool is_float = std::is_same<T, float>::value;
  const Case<T> c = decode<T>(in);
  std::unique_ptr<gma::Prepared<T>> prep;
  if (c.prepared) {
    fz::Expect pex = c.ex;
    pex.flags = c.mix_flags;  // all that preparing reads
    pex.flags.extreme = c.ex.flags.extreme;
    const fz::Outcome o =
        fz::run(pex, [&] { prep.reset(new gma::Prepared<T>(c.mix, c.opt.check_finite)); });
    if (o != fz::Outcome::returned) return;
  }
  forward_mismatch(c, prep.get());
  Matrix<T> out;
  std::vector<gma::Saved<T>> saved;
  gma::State<T> st;
  if (!forward_pieces(c, prep.get(), out, saved, st)) return;
  // Hostile content: the refusals above were the oracle (an extreme one-call forward may
  // report overflow).
  if (!c.ex.must_be_finite() || c.ex.flags.extreme) return;
  gma::Saved<T> one_saved;
  const Matrix<T> one = gma::forward<T>(c.mix, c.q, c.k, c.v, c.opt, &one_saved);
  const double floor_d = static_cast<double>(c.mix.var_floor);
  const bool moderate = c.ex.flags.max_abs <= 1e4 && floor_d >= 1e-4 && c.opt.eps >= 1e-6;
  const double tol =
      (is_float ? 1e-4 : 1e-10) * (max_abs(c.v) + 1e-300) +
      static_cast<double>(c.n() + 1) * static_cast<double>(std::numeric_limits<T>::denorm_min());
  if (moderate)
    MIXATTN_FUZZ_CHECK(max_abs(out - one) <= tol, "pieces differ from one call");
  fz::Expect bex = c.ex;
  bex.flags.merge(c.grad_flags);
  const bool bounded = moderate && !c.grad_flags.non_finite && c.grad_flags.max_abs <= 1e4;
  if (bounded) backward_mismatch(c, saved, one_saved);  // its own backward must not overflow
  if (!bounded) bex.flags.extreme = true;
  gma::Grad<T> chained;
  if (!backward_pieces(c, saved, chained, bex)) return;
  const bool finite = bounded || (c.opt.check_finite && !bex.flags.non_finite);
  fz::check_result(chained.q, c.n(), c.q.cols(), finite, "chained grad q");
  fz::check_result(chained.k, c.n(), c.q.cols(), finite, "chained grad k");
  fz::check_result(chained.v, c.n(), c.dv(), finite, "chained grad v");
  fz::check_result(chained.mixture.mean, c.mix.components(), c.q.cols(), finite, "grad mean");
  // Compared in double only, on moderate inputs (|x| <= 100, eps >= 1e-3), entry by entry
  // against the magnitudes of the entry's terms (term_magnitudes), not against the gradient's
  // own size, which cancellation may leave at rounding level (a gradient that is exactly 0).
  // Each stage (the prefix and suffix sums, den, g and h, dgamma, the softmax, the sums over
  // tokens, the scan's chunks: at most 8) rounds by at most m 2^-53 of its terms' magnitudes,
  // m <= 2 N + 2 = 98 terms (the mixture's sums run over the query and the key side); two
  // orders of the sums differ by at most 2 x 8 x 98 x 2^-53 = 1.7e-13 of them: 1e-12 leaves a
  // margin of 5.
  if (is_float || !bounded || c.ex.flags.max_abs > 100 || c.opt.eps < 1e-3) return;
  const gma::Grad<T> whole = gma::backward<T>(c.mix, c.q, c.k, c.v, c.dout, one_saved, c.opt);
  MIXATTN_FUZZ_CHECK(grads_close(chained, whole, term_magnitudes(c), 1e-12),
                     "chained backward differs from one call");
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
