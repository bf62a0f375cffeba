// libFuzzer target: Gaussian Mixture Attention (SPEC §1), forward and backward, bidirectional and
// causal (any chunk length), plus responsibilities; and linear attention (SPEC §4, the same causal
// scan), Performer (SPEC §5, random features on that scan) and static-codebook VQ attention
// (SPEC §6, one-hot code features on it) on the same inputs and options.
// Decodes the mixture (K ≤ 8 components, r ≤ 16, hostile
// means, raw variances, prior logits, var_floor), options (eps, chunk, causal with N != M,
// check_finite) and inputs (≤ 64 tokens, NaN/Inf/huge/tiny/zero/duplicate rows), and holds every
// call to the oracle in fuzz_common.hpp. Where the inputs are moderate, causal results must not
// depend on the chunk length, responsibility rows must lie on the simplex and linear attention
// Performer and VQ attention must match their O(N^2) double twins.
#include <mixattn/gma.hpp>
#include <mixattn/linear.hpp>
#include <mixattn/performer.hpp>
#include <mixattn/vq.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
namespace gma = mixattn::gma;
namespace linear = mixattn::linear;
namespace performer = mixattn::performer;
namespace vq = mixattn::vq;
namespace fz = mixattn::fuzz;

using fz::magnitude_product;
using fz::max_abs;

template <class T>
bool same_mixture(const gma::Mixture<T>& a, const gma::Mixture<T>& b) {
  return fz::same_bits(a.mean, b.mean) && fz::same_bits(a.var_raw, b.var_raw) &&
         fz::same_bits(a.prior_logit, b.prior_logit) &&
         std::memcmp(&a.var_floor, &b.var_floor, sizeof(T)) == 0;
}

/// The fields GMA's and linear attention's records share (both run the one causal scan).
template <class S>
bool same_scan_record(const S& a, const S& b) {
  return fz::same_bits(a.den, b.den) && fz::same_bits(a.out, b.out) && a.causal == b.causal &&
         std::memcmp(&a.eps, &b.eps, sizeof(double)) == 0 && a.chunk == b.chunk &&
         std::memcmp(&a.fingerprint, &b.fingerprint, sizeof(a.fingerprint)) == 0 &&
         a.valid == b.valid;
}

template <class T>
bool same_saved(const gma::Saved<T>& a, const gma::Saved<T>& b) {
  return same_scan_record(a, b) && fz::same_bits(a.gamma_q, b.gamma_q) &&
         fz::same_bits(a.gamma_k, b.gamma_k) && fz::same_bits(a.vt, b.vt) &&
         fz::same_bits(a.z, b.z) && a.continued == b.continued &&
         fz::same_bits(a.start_S, b.start_S) && fz::same_bits(a.start_z, b.start_z) &&
         a.end_fingerprint == b.end_fingerprint;
}

template <class T>
bool same_saved(const linear::Saved<T>& a, const linear::Saved<T>& b) {
  return same_scan_record(a, b) && fz::same_bits(a.phi_q, b.phi_q) &&
         fz::same_bits(a.phi_k, b.phi_k) && fz::same_bits(a.kv, b.kv) &&
         fz::same_bits(a.ksum, b.ksum);
}

template <class T>
bool same_saved(const performer::Saved<T>& a, const performer::Saved<T>& b) {
  return same_saved(a.attn, b.attn) && fz::same_bits(a.q_at, b.q_at) && a.k_row == b.k_row &&
         a.k_col == b.k_col && std::memcmp(&a.scale, &b.scale, sizeof(double)) == 0 &&
         a.w_fingerprint == b.w_fingerprint;
}

template <class T>
bool same_saved(const vq::Saved<T>& a, const vq::Saved<T>& b) {
  return same_saved(a.attn, b.attn) && fz::same_bits(a.q_at, b.q_at) &&
         fz::same_bits(a.codes, b.codes) && std::memcmp(&a.scale, &b.scale, sizeof(double)) == 0 &&
         a.codebook_fingerprint == b.codebook_fingerprint;
}

/// Whether a record is marked filled (its backward would accept it), and marking one so.
template <class S>
bool filled(const S& saved) {
  return saved.valid;
}
template <class T>
bool filled(const performer::Saved<T>& saved) {
  return filled(saved.attn);
}
template <class T>
bool filled(const vq::Saved<T>& saved) {
  return filled(saved.attn);
}
template <class S>
void mark_filled(S& saved) {
  saved.chunk = 12345;  // recognisable, bit for bit
  saved.valid = true;
}
template <class T>
void mark_filled(performer::Saved<T>& saved) {
  mark_filled(saved.attn);
}
template <class T>
void mark_filled(vq::Saved<T>& saved) {
  mark_filled(saved.attn);
}

/// The backward call's mutation, backward_mode % 10: 0 a grad_out of the wrong shape (rows + 1 x
/// cols), 1 an empty record in place of the forward's, 2 the other causality, 3 another eps;
/// each makes the call invalid (returns true). Any other mode leaves g, sv and bopt as given.
template <class T, class Saved, class Options>
bool mutate_backward(std::uint8_t backward_mode, Index rows, Index cols, const Saved& empty,
                     Matrix<T>& g, const Saved*& sv, Options& bopt) {
  switch (backward_mode % 10) {
    case 0:
      g = Matrix<T>::Zero(rows + 1, cols);
      return true;
    case 1:
      sv = &empty;
      return true;
    case 2:
      bopt.causal = !bopt.causal;
      return true;
    case 3:
      bopt.eps = bopt.eps * 2;
      return true;
    default:
      return false;
  }
}

/// A record marked filled, handed to a forward as its output.
template <class S>
S marked_record() {
  S saved;
  mark_filled(saved);
  return saved;
}

/// README, Errors: a forward that throws for a bad argument or a non-finite input leaves the
/// Saved it was given bitwise as it was; only one whose inputs were all finite and valid and
/// whose result overflowed (domain_error) may change it, and must then leave it marked unfilled.
/// `saved` was marked filled before the call.
template <class S>
void check_saved_after_throw(fz::Outcome o, const fz::Expect& ex, const S& saved, const S& before) {
  const bool overflowed = o == fz::Outcome::domain_error && !ex.invalid && !ex.flags.non_finite;
  if (overflowed)
    MIXATTN_FUZZ_CHECK(same_saved(saved, before) || !filled(saved),
                       "an overflowing forward left saved marked filled");
  else
    MIXATTN_FUZZ_CHECK(same_saved(saved, before), "a throwing forward changed saved");
}

/// SPEC 4.2's exactness oracle in double: O = diag(d)^-1 (mask . Phi_Q Phi_K^T) V,
/// d = rowsum(mask . Phi_Q Phi_K^T) + eps.
template <class T>
Matrix<double> linear_oracle(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                             bool causal, double eps) {
  const auto phi = [](const Matrix<T>& x) {
    const Matrix<double> d = x.template cast<double>();
    return Matrix<double>((d.array() > 0).select(d.array() + 1, d.array().exp()));
  };
  Matrix<double> a = phi(q) * phi(k).transpose();
  if (causal) a.template triangularView<Eigen::StrictlyUpper>().setZero();
  const Vector<double> d = a.rowwise().sum().array() + eps;
  Matrix<double> out = a * v.template cast<double>();
  out.array().colwise() /= d.array();
  return out;
}

/// SPEC 5.2 in double: U = s X W^T - s^2 |x|^2 / 2, Phi = e^(U - c) / sqrt(m) with c the
/// query row's / all keys' largest U, then SPEC 4.2's read-out.
template <class T>
Matrix<double> performer_oracle(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                                const Matrix<T>& w, const performer::Options& opt) {
  const double s = opt.scale > 0 ? opt.scale : std::pow(double(q.cols()), -0.25);
  const auto exponents = [&](const Matrix<T>& x) {
    const Matrix<double> d = x.template cast<double>();
    Matrix<double> u = s * d * w.template cast<double>().transpose();
    u.array().colwise() -= s * s / 2 * d.rowwise().squaredNorm().array();
    return u;
  };
  Matrix<double> uq = exponents(q), uk = exponents(k);
  uq.array().colwise() -= uq.rowwise().maxCoeff().array();
  if (uk.size() > 0) uk.array() -= uk.maxCoeff();
  Matrix<double> a = uq.array().exp().matrix() * uk.array().exp().matrix().transpose() / w.rows();
  if (opt.causal) a.template triangularView<Eigen::StrictlyUpper>().setZero();
  const Vector<double> d = a.rowwise().sum().array() + opt.eps;
  Matrix<double> out = a * v.template cast<double>();
  out.array().colwise() /= d.array();
  return out;
}

/// The operators on the scan, as feature_case calls them.
template <class T>
struct LinearOp {
  using Options = linear::Options;
  using Saved = linear::Saved<T>;
  using Grad = linear::Grad<T>;
  static constexpr const char* name = "linear";
  fz::Flags flags;  // of what the operator reads beyond q, k, v: nothing
  bool invalid(const Options&, Index) const { return false; }
  // Compared with the oracle for entries up to 1e4, to rounding of sums of at most r + M <= 80
  // terms of one sign, relative to max |v|.
  double moderate(bool) const { return 1e4; }
  double tol(bool is_float) const { return is_float ? 1e-4 : 1e-10; }
  // phi grows like |x|: the sums reach r M (1 + A)^3 for entries up to A.
  double growth(double a, Index r, Index m) const {
    return static_cast<double>(r) * static_cast<double>(m) * (1 + a) * (1 + a) * (1 + a);
  }
  Matrix<T> forward(const fz::Strided<T>& q, const fz::Strided<T>& k, const fz::Strided<T>& v,
                    const Options& o, Saved* sv) const {
    return linear::forward<T>(q.view(), k.view(), v.view(), o, sv);
  }
  linear::Grad<T> backward(const fz::Strided<T>& q, const fz::Strided<T>& k,
                           const fz::Strided<T>& v, const fz::Strided<T>& g, const Saved& sv,
                           const Options& o) const {
    return linear::backward<T>(q.view(), k.view(), v.view(), g.view(), sv, o);
  }
  Matrix<double> oracle(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                        const Options& o) const {
    return linear_oracle(q, k, v, o.causal, o.eps);
  }
};

template <class T>
struct PerformerOp {
  using Options = performer::Options;
  using Saved = performer::Saved<T>;
  using Grad = performer::Grad<T>;
  static constexpr const char* name = "performer";
  performer::Features<T> f;
  fz::Flags flags;  // of W
  bool invalid(const Options& o, Index r) const {
    return f.w.rows() == 0 || f.w.cols() != r || !(o.scale >= 0) ||
           !std::isfinite(static_cast<T>(o.scale));
  }
  // The exponents s w . x (r <= 16 terms of entries up to A) carry ~16 A^2 u absolute
  // rounding, which is the weights' relative error: A <= 8 in float gives ~6e-5, A <= 100 in
  // double ~2e-11, under the tolerances by ~10x.
  double moderate(bool is_float) const { return is_float ? 8 : 100; }
  double tol(bool is_float) const { return is_float ? 1e-3 : 1e-9; }
  // Features are <= 1/sqrt(m) whatever the inputs; s w . x and s^2 |x|^2 (s <= 2) and the
  // read-out's sums of M values must stay in range.
  double growth(double a, Index r, Index m) const {
    return 4.0 * static_cast<double>(r) * (1 + a) * (1 + a) + static_cast<double>(m) * (1 + a);
  }
  Matrix<T> forward(const fz::Strided<T>& q, const fz::Strided<T>& k, const fz::Strided<T>& v,
                    const Options& o, Saved* sv) const {
    return performer::forward<T>(q.view(), k.view(), v.view(), f, o, sv);
  }
  performer::Grad<T> backward(const fz::Strided<T>& q, const fz::Strided<T>& k,
                              const fz::Strided<T>& v, const fz::Strided<T>& g, const Saved& sv,
                              const Options& o) const {
    return performer::backward<T>(q.view(), k.view(), v.view(), g.view(), f, sv, o);
  }
  Matrix<double> oracle(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                        const Options& o) const {
    return performer_oracle(q, k, v, f.w, o);
  }
};

/// SPEC 6.2 in double, with the codes the operator's vq::assign gives (checked against brute
/// force in test_baselines; near-ties may round either way in float).
template <class T>
Matrix<double> vq_oracle(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                         const Matrix<T>& c, const vq::Options& opt) {
  const double tau = opt.scale > 0 ? opt.scale : 1 / std::sqrt(double(q.cols()));
  const auto z = vq::assign<T>(k, c);
  const Matrix<double> cd = c.template cast<double>();
  Matrix<double> logit = tau * q.template cast<double>() * cd.transpose();  // N x S
  const Vector<double> top = logit.rowwise().maxCoeff();
  Matrix<double> a(q.rows(), k.rows());
  for (Index i = 0; i < q.rows(); ++i)
    for (Index j = 0; j < k.rows(); ++j)
      a(i, j) = std::exp(logit(i, z[j]) - top[i]) / std::sqrt(double(c.rows()));
  if (opt.causal) a.template triangularView<Eigen::StrictlyUpper>().setZero();
  const Vector<double> d = a.rowwise().sum().array() + opt.eps;
  Matrix<double> out = a * v.template cast<double>();
  out.array().colwise() /= d.array();
  return out;
}

template <class T>
struct VqOp {
  using Options = vq::Options;
  using Saved = vq::Saved<T>;
  using Grad = vq::Grad<T>;
  static constexpr const char* name = "vq";
  Matrix<T> c;      // the codebook, S x r
  fz::Flags flags;  // of the codebook
  bool invalid(const Options& o, Index r) const {
    return c.rows() == 0 || c.cols() != r || !(o.scale >= 0) ||
           !std::isfinite(static_cast<T>(o.scale));
  }
  // As Performer: the logits tau q . C_s carry ~16 A^2 u absolute rounding.
  double moderate(bool is_float) const { return is_float ? 8 : 100; }
  double tol(bool is_float) const { return is_float ? 1e-3 : 1e-9; }
  double growth(double a, Index r, Index m) const {
    return 4.0 * static_cast<double>(r) * (1 + a) * (1 + a) + static_cast<double>(m) * (1 + a);
  }
  Matrix<T> forward(const fz::Strided<T>& q, const fz::Strided<T>& k, const fz::Strided<T>& v,
                    const Options& o, Saved* sv) const {
    return vq::forward<T>(q.view(), k.view(), v.view(), c, o, sv);
  }
  Grad backward(const fz::Strided<T>& q, const fz::Strided<T>& k, const fz::Strided<T>& v,
                const fz::Strided<T>& g, const Saved& sv, const Options& o) const {
    return vq::backward<T>(q.view(), k.view(), v.view(), c, g.view(), sv, o);
  }
  Matrix<double> oracle(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                        const Options& o) const {
    return vq_oracle(q, k, v, c, o);
  }
};

/// What linear attention is given: the GMA case's q, k, v, grad_out and options.
template <class T>
struct LinearCase {
  const Matrix<T>& q;
  const Matrix<T>& k;
  const Matrix<T>& v;
  const Matrix<T>& dout;
  const fz::Strided<T>&qs, &ks, &vs;
  gma::Options gopt;
  fz::Flags flags, grad_flags;
  Index chunk2;
  std::uint8_t backward_mode;
  bool padded;
};

/// Linear attention's, Performer's and VQ attention's oracle: validation, finiteness, sub-convex
/// outputs (positive weights summing to less than 1), the double oracle and chunk independence on
/// moderate inputs, and backward with the same record mismatches as GMA's.
template <class T, class Op>
void feature_case(const LinearCase<T>& c, const Op& op, typename Op::Options opt) {
  const bool is_float = std::is_same<T, float>::value;
  const Index n = c.q.rows(), m = c.k.rows(), r = c.q.cols(), dv = c.v.cols();
  const auto why = [](const char* what) { return std::string(Op::name) + " " + what; };
  opt.causal = c.gopt.causal;
  opt.eps = c.gopt.eps;
  opt.chunk = c.gopt.chunk;
  opt.check_finite = c.gopt.check_finite;
  fz::Expect ex;
  ex.check_finite = opt.check_finite;
  ex.flags = c.flags;
  ex.flags.merge(op.flags);
  ex.invalid = c.k.cols() != r || c.v.rows() != m || (opt.causal && n != m) || (n > 0 && m == 0) ||
               !(opt.eps > 0) || !std::isfinite(opt.eps) || static_cast<T>(opt.eps) == T(0) ||
               opt.chunk < 0 || op.invalid(opt, r);
  const double a = ex.flags.max_abs;
  if (op.growth(a, r, m) > (is_float ? 1e37 : 1e306)) ex.flags.extreme = true;
  const auto unchanged = [&] {
    return fz::same_bits(c.qs.view(), c.q) && fz::same_bits(c.ks.view(), c.k) &&
           fz::same_bits(c.vs.view(), c.v);
  };
  typename Op::Saved saved = marked_record<typename Op::Saved>();
  const typename Op::Saved saved_before = saved;
  Matrix<T> out;
  const fz::Outcome fo = fz::run(ex, [&] { out = op.forward(c.qs, c.ks, c.vs, opt, &saved); });
  MIXATTN_FUZZ_CHECK(unchanged(), why("forward wrote through an input").c_str());
  if (fo != fz::Outcome::returned) {
    check_saved_after_throw(fo, ex, saved, saved_before);
    return;
  }
  fz::check_result(out, n, dv, ex.must_be_finite(), why("forward output").c_str());
  if (ex.must_be_finite() && m > 0)
    MIXATTN_FUZZ_CHECK(max_abs(out) <= max_abs(c.v) * (1 + 1e-4) + 1e-30,
                       why("output outside the convex hull of the values").c_str());
  const bool moderate = ex.must_be_finite() && a <= op.moderate(is_float) && opt.eps >= 1e-6;
  if (moderate) {
    // Subnormal values round in absolute steps of denorm_min (v holding one subnormal: a tenth
    // of it is 0 or denorm_min in float): each of the M weighted terms may lose up to one.
    const double tol =
        op.tol(is_float) * (max_abs(c.v) + 1e-300) +
        static_cast<double>(m + 1) * static_cast<double>(std::numeric_limits<T>::denorm_min());
    MIXATTN_FUZZ_CHECK(max_abs(out.template cast<double>() - op.oracle(c.q, c.k, c.v, opt)) <= tol,
                       why("forward differs from the double oracle").c_str());
    if (opt.causal) {
      typename Op::Options o2 = opt;
      o2.chunk = c.chunk2;
      const Matrix<T> out2 = op.forward(c.qs, c.ks, c.vs, o2, nullptr);
      MIXATTN_FUZZ_CHECK(max_abs(out2 - out) <= tol,
                         why("result depends on the chunk length").c_str());
    }
  }
  fz::Expect bex = ex;
  bex.flags.merge(c.grad_flags);
  // Gradients stay below ~1e21 for moderate inputs, |grad_out| <= 1e4 and eps >= 1e-6;
  // beyond, overflow may be reported (domain_error) or, unchecked, returned.
  const bool finite = moderate && !c.grad_flags.non_finite && c.grad_flags.max_abs <= 1e4;
  if (!finite) bex.flags.extreme = true;
  Matrix<T> g = c.dout;
  typename Op::Saved empty;
  const typename Op::Saved* sv = &saved;
  typename Op::Options bopt = opt;
  if (mutate_backward(c.backward_mode, n, dv, empty, g, sv, bopt)) bex.invalid = true;
  const fz::Strided<T> gs = fz::strided(g, c.padded);
  typename Op::Grad grad;
  const fz::Outcome bo = fz::run(bex, [&] { grad = op.backward(c.qs, c.ks, c.vs, gs, *sv, bopt); });
  MIXATTN_FUZZ_CHECK(unchanged() && fz::same_bits(gs.view(), g),
                     why("backward wrote through an input").c_str());
  if (bo != fz::Outcome::returned) return;
  const bool must = finite || (opt.check_finite && !bex.invalid && !bex.flags.non_finite);
  fz::check_result(grad.q, n, r, must, why("grad q").c_str());
  fz::check_result(grad.k, m, r, must, why("grad k").c_str());
  fz::check_result(grad.v, m, dv, must, why("grad v").c_str());
}

/// A decoded case: shapes (sometimes inconsistent), options, the mixture, q, k, v and grad_out,
/// and what the oracle expects of them.
template <class T>
struct GmaCase {
  Index kc = 0, r = 0, n = 0, m = 0, dv = 0, qr = 0, kr = 0, vrows = 0, chunk2 = 1;
  gma::Options opt;
  T var_floor = T(0);
  double floor_d = 0;
  bool padded = false;
  std::uint8_t backward_mode = 0;
  fz::Expect ex;
  fz::Flags mixture_and_q, q_flags, grad_flags;
  gma::Mixture<T> mix, mix_copy;
  Matrix<T> q, k, v, dout;
};

/// MIXATTN_FUZZ_VERBOSE: the decoded case.
template <class T>
void print_case(const GmaCase<T>& c) {
  const bool is_float = std::is_same<T, float>::value;
  const Index kc = c.kc, r = c.r, n = c.n, m = c.m, dv = c.dv, qr = c.qr, kr = c.kr,
            vrows = c.vrows;
  const gma::Options& opt = c.opt;
  const fz::Expect& ex = c.ex;
  const T var_floor = c.var_floor;
  const std::uint8_t backward_mode = c.backward_mode;
  const gma::Mixture<T>& mix = c.mix;
  const Matrix<T>&q = c.q, &k = c.k, &v = c.v, &dout = c.dout;
  std::cerr << (is_float ? "float" : "double") << " K=" << kc << " r=" << r << " n=" << n
            << " m=" << m << " dv=" << dv << " qr=" << qr << " kr=" << kr << " vrows=" << vrows
            << " causal=" << opt.causal << " eps=" << opt.eps << " chunk=" << opt.chunk
            << " check_finite=" << opt.check_finite << " var_floor=" << var_floor
            << " invalid=" << ex.invalid << " non_finite=" << ex.flags.non_finite
            << " extreme=" << ex.flags.extreme << " max_abs=" << ex.flags.max_abs
            << " backward_mode=" << int(backward_mode % 10) << "\nmean=\n"
            << mix.mean << "\nvar_raw=\n"
            << mix.var_raw << "\nprior_logit=\n"
            << mix.prior_logit.transpose() << "\nq=\n"
            << q << "\nk=\n"
            << k << "\nv=\n"
            << v << "\ndout=\n"
            << dout << "\n";
}

/// Step 1, decode.
template <class T>
GmaCase<T> decode_case(fz::Bytes& in) {
  const bool is_float = std::is_same<T, float>::value;
  Index kc = in.range(1, 8);
  Index r = in.range(1, 16);
  const Index n = in.range(0, 64);
  Index m = in.range(0, 64);
  const Index dv = in.range(0, 16);
  gma::Options opt;
  opt.causal = in.flag();
  if (opt.causal && in.u8() % 4 != 0) m = n;
  Index qr = r, kr = r, vrows = m;
  switch (in.u8() % 12) {
    case 0:
      qr = r + 1;
      break;
    case 1:
      kr = r + 1;
      break;
    case 2:
      vrows = m + 1;
      break;
    case 3:
      kc = 0;
      break;
    default:
      break;
  }
  static constexpr double eps_menu[] = {1e-6,
                                        1e-6,
                                        1e-6,
                                        1e-12,
                                        1,
                                        1e-300,
                                        0,
                                        -1,
                                        std::numeric_limits<double>::quiet_NaN(),
                                        std::numeric_limits<double>::infinity()};
  opt.eps = in.pick(eps_menu);
  static constexpr Index chunk_menu[] = {0, 0, 1, 3, 64, 7, -1};
  opt.chunk = in.pick(chunk_menu);
  opt.check_finite = in.u8() % 5 != 0;
  static constexpr double floor_menu[] = {1e-4,
                                          1e-4,
                                          1,
                                          1e-30,
                                          1e-200,
                                          0,
                                          -1,
                                          std::numeric_limits<double>::quiet_NaN(),
                                          std::numeric_limits<double>::infinity()};
  const T var_floor = static_cast<T>(in.pick(floor_menu));
  const bool padded = in.flag();
  const std::uint8_t backward_mode = in.u8();
  const Index chunk2 = in.range(1, 70);

  fz::Expect ex;
  ex.check_finite = opt.check_finite;
  gma::Mixture<T> mix;
  mix.mean = fz::matrix<T>(in, kc, r, ex.flags);
  mix.var_raw = fz::matrix<T>(in, kc, r, ex.flags);
  mix.prior_logit = fz::vector<T>(in, kc, ex.flags);
  mix.var_floor = var_floor;
  fz::Flags q_flags, kv_flags;
  const Matrix<T> q = fz::matrix<T>(in, n, qr, q_flags);
  ex.flags.merge(q_flags);
  const fz::Flags mixture_and_q = ex.flags;  // all that responsibilities(mix, q) reads
  const Matrix<T> k = fz::matrix<T>(in, m, kr, kv_flags);
  const Matrix<T> v = fz::matrix<T>(in, vrows, dv, kv_flags);
  ex.flags.merge(kv_flags);
  fz::Flags grad_flags;
  const Matrix<T> dout = fz::matrix<T>(in, n, dv, grad_flags);
  q_flags.merge(kv_flags);  // all that linear attention reads

  ex.invalid = kc == 0 || qr != r || kr != r || vrows != m || (opt.causal && n != m) ||
               (n > 0 && m == 0) ||  // queries need at least one key
               !(opt.eps > 0) || !std::isfinite(opt.eps) || opt.chunk < 0 || !(var_floor > 0) ||
               !std::isfinite(static_cast<double>(var_floor));
  // The log-densities are about r (|x| + |mu|)^2 / var_floor: beyond the type's range the
  // responsibilities cannot be formed, which the operator may report as domain_error.
  const double floor_d = static_cast<double>(var_floor);
  const double log_density = static_cast<double>(r) * 4 * ex.flags.max_abs * ex.flags.max_abs /
                             (floor_d > 0 ? floor_d : 1);
  if (log_density > (is_float ? 1e30 : 1e290)) ex.flags.extreme = true;
  // eps is applied in T: one that is 0 there (1e-300 in float) would let a query whose
  // responsibilities miss every key's read 0 / 0, so it is a bad option.
  if (opt.eps > 0 && static_cast<T>(opt.eps) == T(0)) ex.invalid = true;
  GmaCase<T> c;
  c.kc = kc;
  c.r = r;
  c.n = n;
  c.m = m;
  c.dv = dv;
  c.qr = qr;
  c.kr = kr;
  c.vrows = vrows;
  c.chunk2 = chunk2;
  c.opt = opt;
  c.var_floor = var_floor;
  c.floor_d = floor_d;
  c.padded = padded;
  c.backward_mode = backward_mode;
  c.ex = ex;
  c.mixture_and_q = mixture_and_q;
  c.q_flags = q_flags;
  c.grad_flags = grad_flags;
  c.mix = mix;
  c.mix_copy = mix;
  c.q = q;
  c.k = k;
  c.v = v;
  c.dout = dout;
  if (fz::verbose()) print_case(c);
  return c;
}

/// Nothing written through the mixture or q, k, v.
template <class T>
bool inputs_unchanged(const GmaCase<T>& c, const fz::Strided<T>& qs, const fz::Strided<T>& ks,
                      const fz::Strided<T>& vs) {
  return same_mixture(c.mix, c.mix_copy) && fz::same_bits(qs.view(), c.q) &&
         fz::same_bits(ks.view(), c.k) && fz::same_bits(vs.view(), c.v);
}

/// Step 2, the operators on the same scan (linear attention, Performer, VQ attention).
template <class T>
void feature_cases(fz::Bytes& in, const GmaCase<T>& c, const fz::Strided<T>& qs,
                   const fz::Strided<T>& ks, const fz::Strided<T>& vs) {
  const Matrix<T>&q = c.q, &k = c.k, &v = c.v, &dout = c.dout;
  const gma::Options& opt = c.opt;
  const fz::Flags &q_flags = c.q_flags, &grad_flags = c.grad_flags;
  const Index r = c.r, chunk2 = c.chunk2;
  const std::uint8_t backward_mode = c.backward_mode;
  const bool padded = c.padded;
  // Causal GMA, linear attention, Performer and VQ attention share the causal scan: the same
  // inputs and options drive linear attention (SPEC 4), Performer (SPEC 5) and VQ attention
  // (SPEC 6) before GMA's own checks; W, the codebook and the scales are decoded last, so
  // earlier inputs keep their meaning.
  const LinearCase<T> lc{q,       k,          v,      dout,          qs,    ks, vs, opt,
                         q_flags, grad_flags, chunk2, backward_mode, padded};
  feature_case<T>(lc, LinearOp<T>{}, linear::Options{});
  {
    PerformerOp<T> op;
    const Index features = in.range(0, 12);
    const Index wr = in.u8() % 8 == 0 ? r + 1 : r;
    op.f.w = fz::matrix<T>(in, features, wr, op.flags);
    static constexpr double scale_menu[] = {
        0, 0, 0, 0.5, 2, -1, std::numeric_limits<double>::quiet_NaN()};
    performer::Options popt;
    popt.scale = in.pick(scale_menu);
    feature_case<T>(lc, op, popt);
  }
  {
    VqOp<T> op;
    const Index codes = in.range(0, 12);
    op.c = fz::matrix<T>(in, codes, in.u8() % 8 == 0 ? r + 1 : r, op.flags);
    static constexpr double scale_menu[] = {
        0, 0, 0, 0.5, 2, -1, std::numeric_limits<double>::quiet_NaN()};
    vq::Options vopt;
    vopt.scale = in.pick(scale_menu);
    feature_case<T>(lc, op, vopt);
  }
}

/// Step 3, responsibilities of the queries (same validation minus k, v and the options).
template <class T>
void responsibilities_case(const GmaCase<T>& c, const fz::Strided<T>& qs, const fz::Strided<T>& ks,
                           const fz::Strided<T>& vs) {
  const gma::Mixture<T>& mix = c.mix;
  const fz::Expect& ex = c.ex;
  const fz::Flags& mixture_and_q = c.mixture_and_q;
  const gma::Options& opt = c.opt;
  const Index kc = c.kc, qr = c.qr, r = c.r, n = c.n;
  const T var_floor = c.var_floor;
  const auto inputs_unchanged = [&] { return ::inputs_unchanged(c, qs, ks, vs); };
  // Responsibilities of the queries (same validation minus k, v and the options).
  {
    fz::Expect rex = ex;
    rex.flags = mixture_and_q;
    rex.flags.extreme |= ex.flags.extreme;  // the log-density bound above, conservatively
    rex.invalid =
        kc == 0 || qr != r || !(var_floor > 0) || !std::isfinite(static_cast<double>(var_floor));
    Matrix<T> gamma;
    const fz::Outcome o =
        fz::run(rex, [&] { gamma = gma::responsibilities(mix, qs.view(), opt.check_finite); });
    MIXATTN_FUZZ_CHECK(inputs_unchanged(), "responsibilities wrote through an input");
    if (o == fz::Outcome::returned) {
      fz::check_result(gamma, n, kc, rex.must_be_finite(), "responsibilities");
      if (rex.must_be_finite())
        for (Index i = 0; i < n; ++i) {
          MIXATTN_FUZZ_CHECK(gamma.row(i).minCoeff() >= T(0), "negative responsibility");
          MIXATTN_FUZZ_CHECK(std::abs(static_cast<double>(gamma.row(i).sum()) - 1) <= 1e-4,
                             "responsibilities off the simplex");
        }
    }
  }
}

/// Step 4, GMA's forward: the oracle, the record after a throw, the convex hull and chunk
/// independence. Returns whether it returned; `moderate_out` receives whether the inputs were
/// moderate.
template <class T>
bool forward_case(const GmaCase<T>& c, const fz::Strided<T>& qs, const fz::Strided<T>& ks,
                  const fz::Strided<T>& vs, gma::Saved<T>& saved, bool& moderate_out) {
  const bool is_float = std::is_same<T, float>::value;
  const gma::Mixture<T>& mix = c.mix;
  const fz::Expect& ex = c.ex;
  const gma::Options& opt = c.opt;
  const Index n = c.n, m = c.m, dv = c.dv, chunk2 = c.chunk2;
  const double floor_d = c.floor_d;
  const Matrix<T>& v = c.v;
  const auto inputs_unchanged = [&] { return ::inputs_unchanged(c, qs, ks, vs); };
  saved = marked_record<gma::Saved<T>>();
  const gma::Saved<T> saved_before = saved;
  Matrix<T> out;
  const fz::Outcome fo =
      fz::run(ex, [&] { out = gma::forward(mix, qs.view(), ks.view(), vs.view(), opt, &saved); });
  MIXATTN_FUZZ_CHECK(inputs_unchanged(), "forward wrote through an input");
  if (fo != fz::Outcome::returned) {
    check_saved_after_throw(fo, ex, saved, saved_before);
    return false;
  }
  fz::check_result(out, n, dv, ex.must_be_finite(), "forward output");
  // Output rows are convex combinations of value rows, shrunk by eps (SPEC 1.6).
  const bool moderate =
      ex.must_be_finite() && ex.flags.max_abs <= 1e4 && floor_d >= 1e-4 && opt.eps >= 1e-6;
  if (ex.must_be_finite() && m > 0)
    MIXATTN_FUZZ_CHECK(max_abs(out) <= max_abs(v) * (1 + 1e-4) + 1e-30,
                       "output outside the convex hull of the values");

  if (moderate && opt.causal) {
    // The chunk length changes only the rounding (SPEC 1.6).
    gma::Options o2 = opt;
    o2.chunk = chunk2;
    const Matrix<T> out2 = gma::forward(mix, qs.view(), ks.view(), vs.view(), o2);
    const double tol =
        (is_float ? 1e-4 : 1e-10) * (max_abs(v) + 1e-300) +
        static_cast<double>(m + 1) * static_cast<double>(std::numeric_limits<T>::denorm_min());
    MIXATTN_FUZZ_CHECK(max_abs(out2 - out) <= tol, "causal result depends on the chunk length");
  }
  moderate_out = moderate;
  return true;
}

/// Step 5, GMA's backward: the normal call or a mismatched record, shape or option; finite
/// gradients where the bounds of SPEC 1.5 keep them in range.
template <class T>
void backward_case(const GmaCase<T>& c, const fz::Strided<T>& qs, const fz::Strided<T>& ks,
                   const fz::Strided<T>& vs, const gma::Saved<T>& saved, bool moderate) {
  const bool is_float = std::is_same<T, float>::value;
  const gma::Mixture<T>& mix = c.mix;
  const fz::Expect& ex = c.ex;
  const gma::Options& opt = c.opt;
  const fz::Flags& grad_flags = c.grad_flags;
  const Index kc = c.kc, r = c.r, n = c.n, m = c.m, dv = c.dv;
  const double floor_d = c.floor_d;
  const std::uint8_t backward_mode = c.backward_mode;
  const bool padded = c.padded;
  const Matrix<T>& dout = c.dout;
  const auto inputs_unchanged = [&] { return ::inputs_unchanged(c, qs, ks, vs); };
  // Backward: the normal call, or a wrong grad_out shape, an empty Saved, other options.
  fz::Expect bex = ex;
  bex.flags.merge(grad_flags);
  // SPEC 1.5: |dGamma| <= |dO| (M |v| + |O| z) / den with den >= eps, and each dGamma reaches q, k
  // and the mixture times (|x| + |mu|) / var_floor per coordinate. With a tiny eps or var_floor the
  // exact gradients exceed T although every input is moderate; checks then report domain_error.
  const double grad_bound = magnitude_product(
      {grad_flags.max_abs, 2 * static_cast<double>(m + 1) * ex.flags.max_abs / opt.eps,
       2 * static_cast<double>(r) * ex.flags.max_abs / floor_d});
  if (!(grad_bound < (is_float ? 1e36 : 1e300))) bex.flags.extreme = true;
  Matrix<T> g = dout;
  gma::Saved<T> empty;
  const gma::Saved<T>* sv = &saved;
  gma::Options bopt = opt;
  if (mutate_backward(backward_mode, n, dv, empty, g, sv, bopt)) bex.invalid = true;
  const fz::Strided<T> gs = fz::strided(g, padded);
  gma::Grad<T> grad;
  const fz::Outcome bo = fz::run(bex, [&] {
    grad = gma::backward(mix, qs.view(), ks.view(), vs.view(), gs.view(), *sv, bopt);
  });
  MIXATTN_FUZZ_CHECK(inputs_unchanged() && fz::same_bits(gs.view(), g),
                     "backward wrote through an input");
  if (bo != fz::Outcome::returned) return;
  // Gradients can legitimately exceed T for tiny eps or var_floor with huge inputs (with checks
  // on, that is a domain_error); with |x| <= 1e4, var_floor >= 1e-4 and eps >= 1e-6 they stay
  // below ~1e31.
  const bool finite = (opt.check_finite && bex.must_be_finite()) ||
                      (moderate && !grad_flags.non_finite && grad_flags.max_abs <= 1e4);
  fz::check_result(grad.q, n, r, finite, "grad q");
  fz::check_result(grad.k, m, r, finite, "grad k");
  fz::check_result(grad.v, m, dv, finite, "grad v");
  fz::check_result(grad.mixture.mean, kc, r, finite, "grad mean");
  fz::check_result(grad.mixture.var_raw, kc, r, finite, "grad var_raw");
  fz::check_result(grad.mixture.prior_logit, kc, 1, finite, "grad prior_logit");
}

template <class T>
void run_case(fz::Bytes& in) {
  const GmaCase<T> c = decode_case<T>(in);
  const fz::Strided<T> qs = fz::strided(c.q, c.padded), ks = fz::strided(c.k, c.padded),
                       vs = fz::strided(c.v, c.padded);
  feature_cases(in, c, qs, ks, vs);
  responsibilities_case(c, qs, ks, vs);
  gma::Saved<T> saved;
  bool moderate = false;
  if (forward_case(c, qs, ks, vs, saved, moderate)) backward_case(c, qs, ks, vs, saved, moderate);
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
