// libFuzzer target: the baselines — linear attention (SPEC 4), Performer (SPEC 5), static-
// codebook VQ attention (SPEC 6), sliding-window softmax attention (SPEC 7) — and RoPE (SPEC 8)
// through their own entry points. Decodes the operator, shapes (<= 48 tokens, r <= 12, d_v <= 8),
// options (causal, eps, chunk, scale, window, RoPE's start and base, check_finite) and inputs
// (NaN/Inf/huge/tiny/zero/duplicate rows), and holds every call to the oracle in
// fuzz_common.hpp (finite results or the documented exception, gradients finite where the inputs
// are bounded), plus cheap consistency oracles:
//   - a causal operator's output on a prefix of the sequence is the prefix of its output (up to
//     rounding where a chunked scan or a tile ends elsewhere);
//   - window::forward is reference::flash_forward with the same causal window, bit for bit, and a
//     window of N or more keys is causal softmax attention;
//   - RoPE keeps every pair's norm (within the rounding of close_pair in fuzz_reference), and a
//     row's rotation depends only on its position: rotating rows p... from start + p gives the
//     same bits as rotating all rows from start.
#include <mixattn/linear.hpp>
#include <mixattn/performer.hpp>
#include <mixattn/reference.hpp>
#include <mixattn/rope.hpp>
#include <mixattn/vq.hpp>
#include <mixattn/window.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <type_traits>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace linear = mixattn::linear;
namespace performer = mixattn::performer;
namespace vq = mixattn::vq;
namespace window = mixattn::window;
namespace ref = mixattn::reference;
namespace rope = mixattn::rope;
namespace fz = mixattn::fuzz;

using fz::max_abs;

/// One decoded sequence: q, k, v (N x r, N x r, N x d_v; causal operators need M = N), grad_out.
template <class T>
struct Seq {
  Matrix<T> q, k, v, dout;
  fz::Expect ex;
  fz::Flags grad_flags;
  bool causal = false;
  Index n() const { return q.rows(); }
};

template <class T>
Seq<T> draw_seq(fz::Bytes& in, bool always_causal) {
  Seq<T> s;
  const Index n = in.range(0, 48), r = in.range(1, 12), dv = in.range(1, 8);
  s.causal = in.flag() || always_causal;
  const Index m = s.causal ? n : in.range(n > 0 ? 1 : 0, 48);
  s.ex.check_finite = in.u8() % 5 != 0;
  s.q = fz::matrix<T>(in, n, r, s.ex.flags);
  s.k = fz::matrix<T>(in, m, r, s.ex.flags);
  s.v = fz::matrix<T>(in, m, dv, s.ex.flags);
  s.dout = fz::matrix<T>(in, n, dv, s.grad_flags);
  return s;
}

/// The common part: the forward on all rows through the oracle, then (causal, moderate) the
/// forward on a prefix of p rows against the first p rows; `fwd(rows)` runs the operator on the
/// first `rows` rows into `out`. Returns whether the full call returned.
template <class T>
bool forward_and_prefix(fz::Bytes& in, const Seq<T>& s, Matrix<T>& out, bool moderate,
                        bool prefix, double tol,
                        const std::function<Matrix<T>(Index)>& fwd, const char* what) {
  const fz::Outcome o = fz::run(s.ex, [&] { out = fwd(s.n()); });
  if (o != fz::Outcome::returned) return false;
  fz::check_result(out, s.n(), s.v.cols(), s.ex.must_be_finite(), what);
  if (!s.causal || !moderate || !s.ex.must_be_finite() || s.n() == 0) return true;
  const Index p = 1 + static_cast<Index>(in.u8()) % s.n();
  if (!prefix) return true;
  const Matrix<T> head = fwd(p);
  MIXATTN_FUZZ_CHECK(max_abs(head - out.topRows(p)) <= tol, what);
  return true;
}

/// The backward through the oracle: finite gradients where the forward's inputs were finite and
/// moderate and grad_out bounded (or checks on).
template <class T, class G>
void backward_checked(const Seq<T>& s, bool moderate, G&& bwd, const char* what) {
  fz::Expect bex = s.ex;
  bex.flags.merge(s.grad_flags);
  // `moderate` bounds the finite entries only (Flags::max_abs skips NaN and Inf): a NaN or Inf in
  // q, k or v that checks off let through reaches the gradients, which then need not be finite.
  const bool bounded = moderate && !s.ex.flags.non_finite && !s.grad_flags.non_finite &&
                       s.grad_flags.max_abs <= 1e4;
  if (!bounded) bex.flags.extreme = true;
  Matrix<T> gq, gk, gv;
  const fz::Outcome o = fz::run(bex, [&] { bwd(gq, gk, gv); });
  if (o != fz::Outcome::returned) return;
  const bool finite = bounded || (s.ex.check_finite && !bex.flags.non_finite);
  fz::check_result(gq, s.n(), s.q.cols(), finite, what);
  fz::check_result(gk, s.k.rows(), s.q.cols(), finite, what);
  fz::check_result(gv, s.k.rows(), s.v.cols(), finite, what);
}

/// Linear attention, Performer or VQ attention (kind 0, 1, 2) on one sequence.
template <class T>
void feature_case(fz::Bytes& in, int kind) {
  const bool is_float = std::is_same<T, float>::value;
  Seq<T> s = draw_seq<T>(in, false);
  const Index r = s.q.cols(), m = s.k.rows();
  vq::Options opt;  // linear::Options plus the scale Performer and VQ take
  opt.causal = s.causal;
  opt.check_finite = s.ex.check_finite;
  static constexpr double eps_menu[] = {1e-6, 1e-6, 1e-3, 1};
  opt.eps = in.pick(eps_menu);
  static constexpr Index chunk_menu[] = {0, 1, 3, 7, 64};
  opt.chunk = in.pick(chunk_menu);
  static constexpr double scale_menu[] = {0, 0, 0.5, 2};
  opt.scale = in.pick(scale_menu);
  performer::Options popt;
  static_cast<linear::Options&>(popt) = opt;
  popt.scale = opt.scale;
  const Index features = in.range(1, 12);
  const std::uint16_t seed = in.u16();
  const performer::Features<T> f = performer::Features<T>::random(features, r, seed);
  fz::Flags cflags;
  const Matrix<T> codebook = fz::matrix<T>(in, in.range(1, 12), r, cflags);
  if (kind == 2) s.ex.flags.merge(cflags);
  const double a = s.ex.flags.max_abs, rd = static_cast<double>(r), md = static_cast<double>(m);
  // The growth bounds of fuzz_gma's LinearOp, PerformerOp and VqOp.
  const double growth = kind == 0 ? rd * md * (1 + a) * (1 + a) * (1 + a)
                                  : 4.0 * rd * (1 + a) * (1 + a) + md * (1 + a);
  if (growth > (is_float ? 1e37 : 1e306)) s.ex.flags.extreme = true;
  const bool moderate = a <= (kind == 0 ? 1e4 : is_float ? 8 : 100);
  const double tol =
      (is_float ? (kind == 0 ? 1e-4 : 1e-3) : (kind == 0 ? 1e-10 : 1e-9)) * (max_abs(s.v) + 1e-300) +
      (md + 1) * static_cast<double>(std::numeric_limits<T>::denorm_min());
  const auto fwd = [&](Index p) -> Matrix<T> {
    const auto q = s.q.topRows(p), k = s.k.topRows(s.causal ? p : m), v = s.v.topRows(s.causal ? p : m);
    if (kind == 0) return linear::forward<T>(q, k, v, opt);
    if (kind == 1) return performer::forward<T>(q, k, v, f, popt);
    return vq::forward<T>(q, k, v, codebook, opt);
  };
  Matrix<T> out;
  static const char* names[] = {"linear prefix", "performer prefix", "vq prefix"};
  static const char* grad_names[] = {"linear grad", "performer grad", "vq grad"};
  // Performer's key features share one stabiliser, the largest exponent over all keys: a prefix
  // has another, which moves underflow, so its prefix is not compared.
  if (!forward_and_prefix<T>(in, s, out, moderate, kind != 1, tol, fwd, names[kind])) return;
  backward_checked(s, moderate, [&](Matrix<T>& gq, Matrix<T>& gk, Matrix<T>& gv) {
    if (kind == 0) {
      linear::Saved<T> sv;
      linear::forward<T>(s.q, s.k, s.v, opt, &sv);
      const linear::Grad<T> g = linear::backward<T>(s.q, s.k, s.v, s.dout, sv, opt);
      gq = g.q, gk = g.k, gv = g.v;
    } else if (kind == 1) {
      performer::Saved<T> sv;
      performer::forward<T>(s.q, s.k, s.v, f, popt, &sv);
      const performer::Grad<T> g = performer::backward<T>(s.q, s.k, s.v, s.dout, f, sv, popt);
      gq = g.q, gk = g.k, gv = g.v;
    } else {
      vq::Saved<T> sv;
      vq::forward<T>(s.q, s.k, s.v, codebook, opt, &sv);
      const vq::Grad<T> g = vq::backward<T>(s.q, s.k, s.v, codebook, s.dout, sv, opt);
      gq = g.q, gk = g.k, gv = g.v;
    }
  }, grad_names[kind]);
}

/// Sliding-window softmax attention: the reference with the same window, its prefixes, and a
/// window of N or more keys against plain causal attention.
template <class T>
void window_case(fz::Bytes& in) {
  const bool is_float = std::is_same<T, float>::value;
  Seq<T> s = draw_seq<T>(in, true);  // window attention is causal
  const Index n = s.n();
  window::Options opt;
  opt.window = in.range(1, 52);
  opt.check_finite = s.ex.check_finite;
  static constexpr double scale_menu[] = {0, 0, 0.125, 1};
  opt.scale = in.pick(scale_menu);
  const double a = s.ex.flags.max_abs, rd = static_cast<double>(s.q.cols());
  if (a * a * rd > (is_float ? 1e36 : 1e300)) s.ex.flags.extreme = true;
  const bool moderate = a * a * rd <= 40;
  const double tol = (is_float ? 1e-4 : 1e-11) * max_abs(s.v) +
                     static_cast<double>(n + 1) * static_cast<double>(std::numeric_limits<T>::denorm_min());
  const auto fwd = [&](Index p) {
    return window::forward<T>(s.q.topRows(p), s.k.topRows(p), s.v.topRows(p), opt);
  };
  Matrix<T> out;
  if (!forward_and_prefix<T>(in, s, out, moderate, true, tol, fwd, "window prefix")) return;
  ref::Options ro;
  ro.causal = true;
  ro.window = opt.window;
  ro.scale = opt.scale;
  ro.check_finite = opt.check_finite;
  MIXATTN_FUZZ_CHECK(fz::same_bits(out, ref::flash_forward<T>(s.q, s.k, s.v, ro)),
                     "window::forward differs from the reference with its window");
  if (opt.window >= n && moderate && s.ex.must_be_finite()) {
    ro.window = 0;
    MIXATTN_FUZZ_CHECK(max_abs(out - ref::flash_forward<T>(s.q, s.k, s.v, ro)) <= tol,
                       "a window of N keys differs from causal attention");
  }
  backward_checked(s, moderate, [&](Matrix<T>& gq, Matrix<T>& gk, Matrix<T>& gv) {
    window::Saved<T> sv;
    window::forward<T>(s.q, s.k, s.v, opt, &sv);
    const window::Grad<T> g = window::backward<T>(s.q, s.k, s.v, s.dout, sv, opt);
    gq = g.q, gk = g.k, gv = g.v;
  }, "window grad");
}

/// RoPE: norm preservation and position-only dependence, on moderate x with valid options (the
/// hostile cases are fuzz_reference's rope_case).
template <class T>
void rope_case(fz::Bytes& in) {
  const Index n = in.range(0, 48), r = 2 * in.range(1, 8);
  static constexpr double base_menu[] = {10000, 10000, 2, 0.5, 1e6};
  rope::Options opt;
  opt.base = in.pick(base_menu);
  opt.check_finite = in.u8() % 5 != 0;
  static constexpr Index start_menu[] = {0, 0, 1, 7, 1000, Index{1} << 31, -5};
  const Index start = in.pick(start_menu);
  fz::Expect ex;
  ex.check_finite = opt.check_finite;
  const Matrix<T> x = fz::matrix<T>(in, n, r, ex.flags);
  // A rotation overflows only for pairs whose norm is at T's largest value (fuzz_reference).
  if (ex.flags.max_abs > static_cast<double>(std::numeric_limits<T>::max()) / 2)
    ex.flags.extreme = true;
  Matrix<T> y;
  if (fz::run(ex, [&] { y = rope::apply<T>(x, start, opt); }) != fz::Outcome::returned) return;
  fz::check_result(y, n, r, ex.must_be_finite(), "rope output");
  if (!ex.must_be_finite() || ex.flags.extreme) return;
  const double eps = static_cast<double>(std::numeric_limits<T>::epsilon());
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j < r; j += 2) {
      const double x0 = static_cast<double>(x(i, j)), x1 = static_cast<double>(x(i, j + 1));
      const double y0 = static_cast<double>(y(i, j)), y1 = static_cast<double>(y(i, j + 1));
      // close_pair's bound: 3 roundings in double and one to T, relative to |x0| + |x1|.
      const double bound = 2 * ((std::abs(x0) + std::abs(x1)) * (3 * 0x1p-53 + eps) +
                                static_cast<double>(std::numeric_limits<T>::denorm_min()));
      MIXATTN_FUZZ_CHECK(std::abs(std::hypot(y0, y1) - std::hypot(x0, x1)) <= bound,
                         "rope changed a pair's norm");
    }
  if (n == 0) return;
  const Index p = static_cast<Index>(in.u8()) % n;
  const Matrix<T> tail = rope::apply<T>(x.bottomRows(n - p), start + p, opt);
  MIXATTN_FUZZ_CHECK(fz::same_bits(tail, y.bottomRows(n - p)),
                     "rope of rows p... from start + p differs from rows p... from start");
}

template <class T>
void run_case(fz::Bytes& in) {
  const std::uint8_t op = in.u8();
  if (fz::verbose()) std::cerr << "operator " << int(op % 5) << "\n";
  switch (op % 5) {
    case 0:
    case 1:
    case 2: feature_case<T>(in, op % 5); break;
    case 3: window_case<T>(in); break;
    default: rope_case<T>(in); break;
  }
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
