// libFuzzer target: Linformer (linformer.hpp, SPEC §11). Decodes d, d_v, k_proj <= 8, a sequence
// of <= 48 tokens (NaN/Inf/huge/tiny/zero/duplicate rows), E and F, options (scale, causal,
// check_finite), the form (value or _into) and a mismatch to inject. Every call is held to the
// oracle in fuzz_common.hpp, and:
//   - causal = true is refused with std::invalid_argument naming causal;
//   - for moderate inputs (logits within 1e3 in double) the output equals the formula of SPEC 11.1
//     computed with plain Eigen, and the value and _into forms give the same bits, forward and
//     backward;
//   - the backward's gradients have the inputs' shapes and are finite when the call must be;
//   - E of another length than the sequence, F of another k_proj, and a record given other q or
//     E are refused with std::invalid_argument naming the argument.
#include <mixattn/linformer.hpp>

#include "fuzz_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace linformer = mixattn::linformer;
namespace fz = mixattn::fuzz;

using fz::max_abs;

template <class T>
struct Case {
  linformer::Options opt;
  Matrix<T> q, k, v, E, F, dout;
  fz::Expect ex;
  fz::Flags grad_flags;
  bool into = false;
  std::uint8_t mismatch = 0;
  Index n() const { return q.rows(); }
};

template <class T>
Case<T> decode(fz::Bytes& in) {
  Case<T> c;
  const Index d = in.range(1, 8), dv = in.range(1, 8), n = in.range(0, 48), kp = in.range(1, 8);
  static constexpr double scale_menu[] = {0, 0, 0.5, 3};
  c.opt.scale = in.pick(scale_menu);
  c.opt.causal = in.u8() % 8 == 7;
  c.opt.check_finite = in.u8() % 5 != 0;
  c.into = in.flag();
  c.mismatch = in.u8();
  c.ex.check_finite = c.opt.check_finite;
  c.ex.invalid = c.opt.causal;
  c.q = fz::matrix<T>(in, n, d, c.ex.flags);
  c.k = fz::matrix<T>(in, n, d, c.ex.flags);
  c.v = fz::matrix<T>(in, n, dv, c.ex.flags);
  c.E = fz::matrix<T>(in, kp, n, c.ex.flags);
  c.F = fz::matrix<T>(in, kp, n, c.ex.flags);
  c.dout = fz::matrix<T>(in, n, dv, c.grad_flags);
  return c;
}

/// SPEC 11.1 with plain Eigen in double.
template <class T>
Matrix<double> twin_forward(const Case<T>& c, double& logit_bound) {
  const Matrix<double> q = c.q.template cast<double>(), k = c.k.template cast<double>();
  const Matrix<double> Kp = c.E.template cast<double>() * k;
  const Matrix<double> Vp = c.F.template cast<double>() * c.v.template cast<double>();
  const double scale = c.opt.scale > 0 ? c.opt.scale : 1 / std::sqrt(double(q.cols()));
  Matrix<double> S = scale * q * Kp.transpose();
  logit_bound = max_abs(S);
  for (Index i = 0; i < S.rows(); ++i) {
    S.row(i) = (S.row(i).array() - S.row(i).maxCoeff()).exp().matrix();
    S.row(i) /= S.row(i).sum();
  }
  return S * Vp;
}

/// The injected refusals (finite, valid inputs).
template <class T>
void mismatches(const Case<T>& c) {
  const Matrix<T> longer_E = Matrix<T>::Zero(c.E.rows(), c.n() + 1);
  const Matrix<T> other_F = Matrix<T>::Zero(c.F.rows() + 1, c.n());
  switch (c.mismatch % 6) {
    case 1:
      fz::expect_invalid_naming(
          "E", [&] { linformer::forward<T>(c.q, c.k, c.v, longer_E, c.F, c.opt); },
          "E of another length");
      break;
    case 2:
      fz::expect_invalid_naming(
          "F", [&] { linformer::forward<T>(c.q, c.k, c.v, c.E, other_F, c.opt); },
          "F of another k_proj");
      break;
    case 3:
    case 4: {
      if (c.n() == 0) break;
      linformer::Saved<T> saved;
      linformer::forward<T>(c.q, c.k, c.v, c.E, c.F, c.opt, &saved);
      Matrix<T> q = c.q, E = c.E;
      Matrix<T>& x = c.mismatch % 6 == 3 ? q : E;
      x(0, 0) = x(0, 0) == T(0) ? T(1) : T(0);
      fz::expect_invalid_naming(
          c.mismatch % 6 == 3 ? "q" : "E",
          [&] { linformer::backward<T>(q, c.k, c.v, E, c.F, c.dout, saved, c.opt); },
          "a record of other data");
      break;
    }
    default:
      break;
  }
}

template <class T>
void run_case(fz::Bytes& in) {
  const Case<T> c = decode<T>(in);
  if (c.opt.causal) {
    fz::expect_invalid_naming(
        "causal", [&] { linformer::forward<T>(c.q, c.k, c.v, c.E, c.F, c.opt); }, "causal");
    return;
  }
  Matrix<T> out;
  linformer::Saved<T> saved;
  const fz::Outcome r = fz::run(c.ex, [&] {
    if (c.into)
      linformer::forward_into<T>(out, c.q, c.k, c.v, c.E, c.F, c.opt, &saved);
    else
      out = linformer::forward<T>(c.q, c.k, c.v, c.E, c.F, c.opt, &saved);
  });
  if (r != fz::Outcome::returned) return;
  fz::check_result(out, c.n(), c.v.cols(), c.ex.must_be_finite(), "output");
  if (!c.ex.must_be_finite() || c.ex.flags.extreme) return;  // hostile: the refusals were it
  const bool moderate = c.ex.flags.max_abs <= 1e4 && std::is_same<T, double>::value;
  if (moderate) {
    double logits = 0;
    const Matrix<double> want = twin_forward(c, logits);
    // Rounding of the logits (relative eps, at most 1e3 here) moves P by eps 1e3 at most; the
    // output is a convex combination of V' rows: 1e-9 of V''s size leaves a wide margin.
    const double vp = max_abs(c.F.template cast<double>() * c.v.template cast<double>());
    if (logits <= 1e3)
      MIXATTN_FUZZ_CHECK(max_abs(out.template cast<double>() - want) <= 1e-9 * vp + 1e-300,
                         "forward differs from the formula");
  }
  const Matrix<T> other = linformer::forward<T>(c.q, c.k, c.v, c.E, c.F, c.opt);
  MIXATTN_FUZZ_CHECK(fz::same_values(other, out), "forms differ");
  fz::Expect bex = c.ex;
  bex.flags.merge(c.grad_flags);
  linformer::Grad<T> g;
  const fz::Outcome rb = fz::run(bex, [&] {
    if (c.into)
      linformer::backward_into<T>(g, c.q, c.k, c.v, c.E, c.F, c.dout, saved, c.opt);
    else
      g = linformer::backward<T>(c.q, c.k, c.v, c.E, c.F, c.dout, saved, c.opt);
  });
  if (rb != fz::Outcome::returned) return;
  const bool finite = bex.must_be_finite() && !bex.flags.extreme;
  fz::check_result(g.q, c.n(), c.q.cols(), finite, "grad q");
  fz::check_result(g.k, c.n(), c.k.cols(), finite, "grad k");
  fz::check_result(g.v, c.n(), c.v.cols(), finite, "grad v");
  fz::check_result(g.E, c.E.rows(), c.n(), finite, "grad E");
  fz::check_result(g.F, c.F.rows(), c.n(), finite, "grad F");
  const linformer::Grad<T> g2 =
      linformer::backward<T>(c.q, c.k, c.v, c.E, c.F, c.dout, saved, c.opt);
  MIXATTN_FUZZ_CHECK(fz::same_values(g.q, g2.q) && fz::same_values(g.k, g2.k) &&
                         fz::same_values(g.v, g2.v) && fz::same_values(g.E, g2.E) &&
                         fz::same_values(g.F, g2.F),
                     "backward forms differ");
  if (!bex.flags.non_finite && c.ex.flags.max_abs <= 1e4) mismatches(c);
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
