// libFuzzer target: reference softmax attention (SPEC §3), naive and flash, forward and backward,
// and RoPE (SPEC §8) on the same queries.
// Decodes shapes (≤ 64 tokens, ≤ 16 dims, sometimes inconsistent), options (scale 0, tiny, huge,
// NaN, Inf; causal with N != M; check_finite on/off; a sliding window, SPEC §7, of 0 or
// 1 ... N + 2 keys when causal, now and then one without causal or a negative one) and values
// (NaN, Inf, huge, tiny, zero and duplicated rows), and holds every call to the oracle in
// fuzz_common.hpp. Where the logits are moderate, naive and flash must also agree.
// RoPE, from bytes after all of the above (rope_case): rope::apply and rope::backward in every
// form (value, _into, _into onto the input, in place on a row block) on q, q less a column or q
// tiled (widths 0 ... 128, odd ones refused), at starts from the ends of Index to 2^62, 2^53 and
// negatives, with bases ordinary, tiny (to denorm_min), huge and invalid, check_finite on/off.
// Oracle: invalid_argument for bad widths, bases, positions beyond Index and angles that overflow
// double; domain_error for finite x only where a pair's norm reaches T's largest value; the
// forms agree bit for bit; finite results match a long double twin of the pairwise rotation
// within the rounding bound in close_pair, and backward(apply(x)) returns x within it.
#include <mixattn/reference.hpp>
#include <mixattn/rope.hpp>

#include "fuzz_common.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace ref = mixattn::reference;
namespace fz = mixattn::fuzz;

using fz::magnitude_product;
using fz::max_abs;
/// A decoded softmax case: shapes (valid most of the time), options and inputs.
template <class T>
struct SoftmaxCase {
  Index n = 0, m = 0, r = 0, dv = 0, kr = 0, vrows = 0;
  ref::Options opt;
  bool padded = false;
  std::uint8_t backward_mode = 0;
  fz::Expect ex;
  fz::Flags grad_flags;
  Matrix<T> q, k, v, dout;
};

/// Step 1, decode.
template <class T>
SoftmaxCase<T> decode_softmax(fz::Bytes& in) {
  // Shapes: valid most of the time, one dimension broken otherwise.
  const Index n = in.range(0, 64);
  Index m = in.range(0, 64);
  Index r = in.range(1, 16);
  const Index dv = in.range(0, 16);
  Index kr = r, vrows = m;
  ref::Options opt;
  opt.causal = in.flag();
  if (opt.causal && in.u8() % 4 != 0) m = vrows = n;
  switch (in.u8() % 10) {
    case 0:
      kr = r + 1;
      break;
    case 1:
      vrows = m + 1;
      break;
    case 2:
      r = 0;
      kr = 0;
      break;
    default:
      break;
  }
  static constexpr double scales[] = {0,
                                      0,
                                      0,
                                      1,
                                      0.125,
                                      -1,
                                      1e-30,
                                      30,
                                      1e30,
                                      std::numeric_limits<double>::quiet_NaN(),
                                      std::numeric_limits<double>::infinity()};
  opt.scale = in.pick(scales);
  opt.check_finite = in.u8() % 5 != 0;
  const bool padded = in.flag();

  fz::Expect ex;
  ex.check_finite = opt.check_finite;
  ex.invalid = r == 0 || kr != r || vrows != m || (n > 0 && m == 0) || (opt.causal && n != m) ||
               !std::isfinite(opt.scale);
  // A float scale of 1e30 overflows scale * q . k for ordinary q, k.
  if (std::abs(opt.scale) > 1e6 && std::is_same<T, float>::value) ex.flags.extreme = true;

  const Matrix<T> q = fz::matrix<T>(in, n, r, ex.flags);
  const Matrix<T> k = fz::matrix<T>(in, m, kr, ex.flags);
  const Matrix<T> v = fz::matrix<T>(in, vrows, dv, ex.flags);
  fz::Flags grad_flags;
  const Matrix<T> dout = fz::matrix<T>(in, n, dv, grad_flags);
  const std::uint8_t backward_mode = in.u8();
  // The window is drawn after everything else, so that the inputs before it decode as they did
  // before windows existed (an exhausted input reads 0: no window).
  const std::uint8_t window_byte = in.u8();
  if (opt.causal && window_byte % 4 != 0)
    opt.window = 1 + static_cast<Index>(window_byte) % (n + 2);
  else if (!opt.causal && window_byte % 16 == 1)
    opt.window = 1 + window_byte / 16;      // invalid: a window needs causal
  if (window_byte == 255) opt.window = -1;  // invalid: negative
  ex.invalid = ex.invalid || opt.window < 0 || (opt.window > 0 && !opt.causal);
  if (fz::verbose())
    std::cerr << (sizeof(T) == 4 ? "float" : "double") << " n=" << n << " m=" << m << " r=" << r
              << " kr=" << kr << " dv=" << dv << " vrows=" << vrows << " causal=" << opt.causal
              << " scale=" << opt.scale << " check_finite=" << opt.check_finite
              << " window=" << opt.window << " padded=" << padded << " invalid=" << ex.invalid
              << " non_finite=" << ex.flags.non_finite << " extreme=" << ex.flags.extreme
              << " backward_mode=" << int(backward_mode % 12) << "\nq=\n"
              << q << "\nk=\n"
              << k << "\nv=\n"
              << v << "\ndout=\n"
              << dout << "\n";
  SoftmaxCase<T> c;
  c.n = n;
  c.m = m;
  c.r = r;
  c.dv = dv;
  c.kr = kr;
  c.vrows = vrows;
  c.opt = opt;
  c.padded = padded;
  c.backward_mode = backward_mode;
  c.ex = ex;
  c.grad_flags = grad_flags;
  c.q = q;
  c.k = k;
  c.v = v;
  c.dout = dout;
  return c;
}

/// What the two forms (naive, flash) gave.
template <class T>
struct SoftmaxRun {
  Matrix<T> out[2];
  ref::Saved<T> saved[2];
  bool returned[2] = {false, false};
  bool moderate = false;
  Matrix<T> grads[2][3];
  bool back_returned[2] = {false, false};
};

/// Step 2, forward, both forms, and their agreement where the logits are moderate. Returns
/// whether either returned.
template <class T>
bool softmax_forward(const SoftmaxCase<T>& c, const fz::Strided<T>& qs, const fz::Strided<T>& ks,
                     const fz::Strided<T>& vs, SoftmaxRun<T>& run) {
  const Index n = c.n, m = c.m, r = c.r, dv = c.dv;
  const ref::Options& opt = c.opt;
  const fz::Expect& ex = c.ex;
  const Matrix<T>&q = c.q, &k = c.k, &v = c.v;
  Matrix<T>(&out)[2] = run.out;
  ref::Saved<T>(&saved)[2] = run.saved;
  bool(&returned)[2] = run.returned;
  for (int impl = 0; impl < 2; ++impl) {
    const fz::Outcome o = fz::run(ex, [&] {
      out[impl] = impl == 0
                      ? ref::naive_forward<T>(qs.view(), ks.view(), vs.view(), opt, &saved[impl])
                      : ref::flash_forward<T>(qs.view(), ks.view(), vs.view(), opt, &saved[impl]);
    });
    MIXATTN_FUZZ_CHECK(
        fz::same_bits(qs.view(), q) && fz::same_bits(ks.view(), k) && fz::same_bits(vs.view(), v),
        "forward wrote through an input");
    if (o != fz::Outcome::returned) continue;
    returned[impl] = true;
    fz::check_result(out[impl], n, dv, ex.must_be_finite(), "forward output");
  }
  if (!returned[0] && !returned[1]) return false;

  // Moderate logits: the two forms compute the same function up to rounding.
  const double scale = opt.scale != 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(r));
  const bool moderate =
      ex.must_be_finite() &&
      magnitude_product({std::abs(scale), max_abs(q), max_abs(k), static_cast<double>(r)}) <= 40;
  // Each probability carries a few ulps; the output error is at most about M ulps of max |v|.
  // Subnormal v round in absolute steps: each of the M products P_ij v_j may lose up to one
  // denorm_min, whichever way the two forms happen to round it.
  const double tol =
      (std::is_same<T, float>::value ? 1e-4 : 1e-11) * max_abs(v) +
      static_cast<double>(m + 1) * static_cast<double>(std::numeric_limits<T>::denorm_min());
  if (moderate && returned[0] && returned[1])
    MIXATTN_FUZZ_CHECK(max_abs(out[0] - out[1]) <= tol, "naive and flash forward disagree");
  run.moderate = moderate;
  return true;
}

/// Step 3, backward of each form that returned: the normal call, a wrong grad_out shape, an
/// empty Saved or the other form's.
template <class T>
void softmax_backward(const SoftmaxCase<T>& c, const fz::Strided<T>& qs, const fz::Strided<T>& ks,
                      const fz::Strided<T>& vs, SoftmaxRun<T>& run) {
  const Index n = c.n, m = c.m, r = c.r, dv = c.dv;
  const ref::Options& opt = c.opt;
  const fz::Expect& ex = c.ex;
  const fz::Flags& grad_flags = c.grad_flags;
  const Matrix<T>&q = c.q, &k = c.k, &v = c.v, &dout = c.dout;
  const std::uint8_t backward_mode = c.backward_mode;
  const bool padded = c.padded;
  const ref::Saved<T>(&saved)[2] = run.saved;
  const bool(&returned)[2] = run.returned;
  Matrix<T>(&grads)[2][3] = run.grads;
  bool(&back_returned)[2] = run.back_returned;
  // Backward: grad_out of the right shape, or a wrong one, or a Saved from nowhere / the other
  // form.
  fz::Expect bex = ex;
  bex.flags.merge(grad_flags);
  Matrix<T> g = dout;
  const ref::Saved<T> empty;
  for (int impl = 0; impl < 2; ++impl) {
    if (!returned[impl]) continue;
    fz::Expect this_ex = bex;
    const ref::Saved<T>* sv = &saved[impl];
    switch (backward_mode % 12) {
      case 0:
        g = Matrix<T>::Zero(n + 1, dv);
        this_ex.invalid = true;
        break;
      case 1:
        sv = &empty;
        this_ex.invalid = true;
        break;
      case 2:
        if (returned[1 - impl]) {
          sv = &saved[1 - impl];
          this_ex.invalid = true;
        }
        break;
      default:
        g = dout;
        break;
    }
    const fz::Strided<T> gs = fz::strided(g, padded);
    ref::Grad<T> grad;
    const fz::Outcome o = fz::run(this_ex, [&] {
      grad = impl == 0
                 ? ref::naive_backward<T>(qs.view(), ks.view(), vs.view(), gs.view(), *sv, opt)
                 : ref::flash_backward<T>(qs.view(), ks.view(), vs.view(), gs.view(), *sv, opt);
    });
    MIXATTN_FUZZ_CHECK(fz::same_bits(qs.view(), q) && fz::same_bits(ks.view(), k) &&
                           fz::same_bits(vs.view(), v) && fz::same_bits(gs.view(), g),
                       "backward wrote through an input");
    if (o != fz::Outcome::returned) continue;
    const bool finite = this_ex.must_be_finite();
    fz::check_result(grad.q, n, r, finite, "grad q");
    fz::check_result(grad.k, m, r, finite, "grad k");
    fz::check_result(grad.v, m, dv, finite, "grad v");
    back_returned[impl] = true;
    grads[impl][0] = grad.q;
    grads[impl][1] = grad.k;
    grads[impl][2] = grad.v;
  }
}

/// Step 4, the two backwards' agreement, within bounds of each gradient's size.
template <class T>
void softmax_compare_grads(const SoftmaxCase<T>& c, const SoftmaxRun<T>& run) {
  const Index n = c.n, m = c.m, r = c.r, dv = c.dv;
  const bool moderate = run.moderate;
  const fz::Flags& grad_flags = c.grad_flags;
  const Matrix<T>&q = c.q, &k = c.k, &v = c.v, &dout = c.dout;
  const double scale = c.opt.scale != 0 ? c.opt.scale : 1.0 / std::sqrt(static_cast<double>(r));
  const Matrix<T>(&grads)[2][3] = run.grads;
  const bool(&back_returned)[2] = run.back_returned;
  // Both forms associate the scale the same way (S = (scale Q) K^T, dK = dS^T (scale Q),
  // dQ = scale (dS K)), so that with extreme scales and subnormal inputs neither underflows an
  // intermediate product the other keeps (found by this check: q ~ 1e-323, scale = 1e30).
  if (moderate && !grad_flags.non_finite && !grad_flags.extreme && back_returned[0] &&
      back_returned[1]) {
    // Magnitude bounds of each gradient (P rows sum to 1, |dP_ij| <= dv max|dO| max|v|):
    // |dq| <= 2 s max|k| max|dP|, |dk| <= 2 N s max|q| max|dP|, |dv| <= N max|dO|. The two forms
    // round differently by a few ulps per term of sums up to N + M + d_v long; exact zeros (M = 1)
    // are why the bound, not the gradients' own size, sets the scale.
    // An empty q or grad_out has max_abs 0 while the other factors may overflow (k at the
    // largest double and scale 1e30): a zero factor must win over an infinite product, which
    // would otherwise make the bound NaN and the comparison fail for equal gradients.
    const double dp = magnitude_product({static_cast<double>(dv), max_abs(dout), max_abs(v)});
    const double bound[3] = {
        magnitude_product({2, std::abs(scale), max_abs(k), dp}),
        magnitude_product({2 * static_cast<double>(n), std::abs(scale), max_abs(q), dp}),
        magnitude_product({static_cast<double>(n), max_abs(dout)})};
    const double ulp = std::numeric_limits<T>::epsilon();
    for (int a = 0; a < 3; ++a) {
      // Subnormal values round in absolute steps of denorm_min, not relative ones.
      const double floor = static_cast<double>(std::numeric_limits<T>::denorm_min()) *
                           (1 + max_abs(dout)) * 64 * static_cast<double>(n + m + dv + 1);
      const double gtol = 8 * static_cast<double>(n + m + dv + 1) * ulp * bound[a] + floor;
      MIXATTN_FUZZ_CHECK(max_abs(grads[0][a] - grads[1][a]) <= gtol,
                         "naive and flash backward disagree");
    }
  }
}

/// Softmax attention, naive and flash, forward and backward; q_out receives the drawn q for
/// rope_case (whatever happens after the draw).
template <class T>
void softmax_case(fz::Bytes& in, Matrix<T>& q_out) {
  const SoftmaxCase<T> c = decode_softmax<T>(in);
  q_out = c.q;
  const fz::Strided<T> qs = fz::strided(c.q, c.padded), ks = fz::strided(c.k, c.padded),
                       vs = fz::strided(c.v, c.padded);
  SoftmaxRun<T> run;
  if (!softmax_forward(c, qs, ks, vs, run)) return;
  softmax_backward(c, qs, ks, vs, run);
  softmax_compare_grads(c, run);
}

// ---- RoPE (SPEC §8) on the drawn q ----

/// Position of row `row` after `start`, as rope.hpp forms it (start + row in Index, then one
/// rounding to double). Summed in long double, which cannot overflow (x86-64's 64-bit mantissa
/// also holds every Index exactly): the twin stays defined where the library must refuse.
inline double position(Index start, Index row) {
  return static_cast<double>(static_cast<long double>(start) + static_cast<long double>(row));
}

/// The slow, obvious twin of one rotated entry (SPEC 8.1): pair (x0, x1) of row `row`, pair index
/// i of r/2, rotated by sign * p theta_i. The angle, its cosine and sine are formed in double as
/// SPEC 8.1 specifies (an angle p theta_i of 1e18 rad has an ulp of 128 rad, so any other rounding
/// of it would be another rotation altogether); the rotation itself is in long double.
inline void twin_pair(double base, Index r, Index i, double p, double sign, long double x0,
                      long double x1, long double& y0, long double& y1) {
  const double theta = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(r));
  const double a = p * theta;
  const long double c = std::cos(a), s = sign * std::sin(a);
  y0 = x0 * c - x1 * s;
  y1 = x0 * s + x1 * c;
}

/// Whether rope.hpp's result for (x0, x1) at this position is within the rounding the library
/// may commit: it forms x0 c - x1 s in double (two products and a difference, at most 3 roundings
/// of 2^-53 relative to terms bounded by |x0| + |x1|), then rounds once to T (half an ulp of T
/// relative to a result bounded by |x0| + |x1|; subnormal results round in absolute steps of
/// denorm_min / 2). `slack` scales the bound (2 for the margin; more for two rotations).
template <class T>
bool close_pair(long double want, T got, long double x0, long double x1, double slack) {
  const double mag = static_cast<double>(std::fabs(x0) + std::fabs(x1));
  const double tol =
      slack * (mag * (3 * 0x1p-53 + 0.5 * static_cast<double>(std::numeric_limits<T>::epsilon())) +
               static_cast<double>(std::numeric_limits<T>::denorm_min()));
  return static_cast<double>(std::fabs(want - static_cast<long double>(got))) <= tol;
}

/// Step 1 of rope_case, the start position: 0, small, negative, near 2^31, 2^53, 2^62, or the
/// ends of Index.
inline Index draw_start(std::uint8_t start_kind, std::uint8_t small) {
  constexpr Index top = std::numeric_limits<Index>::max(),
                  bottom = std::numeric_limits<Index>::min();
  Index start = 0;
  switch (start_kind % 12) {
    case 0:
      start = 0;
      break;
    case 1:
      start = small;
      break;
    case 2:
      start = -static_cast<Index>(small) - 1;
      break;
    case 3:
      start = (Index{1} << 31) - small;
      break;
    case 4:
      start = (Index{1} << 53) - small;
      break;
    case 5:
      start = -(Index{1} << 53) + small;
      break;
    case 6:
      start = Index{1} << 62;
      break;
    case 7:
      start = top - small;  // start + N - 1 overflows Index when N - 1 > small
      break;
    case 8:
      start = bottom + small;
      break;
    case 9:
      start = top;
      break;
    default:
      start = small % 16;
      break;
  }
  return start;
}

/// A decoded RoPE case.
template <class T>
struct RopeCase {
  Matrix<T> x;
  Index start = 0, n = 0, r = 0;
  mixattn::rope::Options opt;
  bool padded = false;
  fz::Expect ex;
};

/// Step 2 of rope_case, decode: x from q, the start, the options and the expectations. Returns
/// false when the bytes ask for no RoPE.
template <class T>
bool decode_rope(fz::Bytes& in, const Matrix<T>& q, RopeCase<T>& c) {
  const std::uint8_t mode = in.u8();
  if (mode % 4 == 0) return false;
  Matrix<T> x;
  switch ((mode >> 2) % 4) {
    case 0:
      x = q;
      break;
    case 1:
      x = q.leftCols(std::max<Index>(q.cols() - 1, 0));
      break;
    default: {
      const Index reps = 2 + (mode >> 4) % 7;
      x.resize(q.rows(), q.cols() * reps);
      // (an empty x has no storage for Eigen to offset into)
      for (Index t = 0; t < reps && x.size() > 0; ++t) x.middleCols(t * q.cols(), q.cols()) = q;
      break;
    }
  }
  const std::uint8_t start_kind = in.u8(), small = in.u8();
  constexpr Index top = std::numeric_limits<Index>::max();
  const Index start = draw_start(start_kind, small);
  static constexpr double bases[] = {10000,
                                     10000,
                                     2,
                                     1,
                                     0.5,
                                     1e-3,
                                     1e300,
                                     std::numeric_limits<double>::max(),
                                     1e-300,
                                     std::numeric_limits<double>::denorm_min(),
                                     0,
                                     -1,
                                     std::numeric_limits<double>::quiet_NaN(),
                                     std::numeric_limits<double>::infinity(),
                                     -std::numeric_limits<double>::infinity()};
  mixattn::rope::Options opt;
  opt.base = in.pick(bases);
  opt.check_finite = in.u8() % 5 != 0;
  const bool padded = in.flag();
  const Index n = x.rows(), r = x.cols();

  fz::Expect ex;
  ex.check_finite = opt.check_finite;
  ex.invalid = r < 2 || r % 2 != 0 || !(std::isfinite(opt.base) && opt.base > 0) ||
               (n > 0 && start > top - (n - 1));  // the last position is no Index
  // Angles p theta_i that overflow double (SPEC 8.3; a subnormal base), by brute force over every
  // theta_i at the first and last rows (the largest |p| is at one of them).
  if (!ex.invalid)
    for (Index i = 0; 2 * i < r && n > 0; ++i) {
      const double theta =
          std::pow(opt.base, -2.0 * static_cast<double>(i) / static_cast<double>(r));
      if (!std::isfinite(theta * position(start, 0)) ||
          !std::isfinite(theta * position(start, n - 1)))
        ex.invalid = true;
    }
  for (Index i = 0; i < x.size(); ++i) fz::classify<T>(static_cast<double>(x.data()[i]), ex.flags);
  // A rotation keeps each pair's norm, so a result overflows T only if some pair's norm is
  // within the library's rounding (3 · 2^-53 relative, see close_pair) of T's largest value:
  // domain_error is allowed (and, checks off, an infinity) exactly then, not for "large" x.
  long double max_norm = 0;
  for (Index row = 0; row < n; ++row)
    for (Index i = 0; 2 * i + 1 < r; ++i)
      max_norm = std::max(max_norm, std::hypot(static_cast<long double>(x(row, 2 * i)),
                                               static_cast<long double>(x(row, 2 * i + 1))));
  ex.flags.extreme =
      max_norm > static_cast<long double>(std::numeric_limits<T>::max()) * (1 - 4 * 0x1p-53L);
  if (fz::verbose())
    std::cerr << "rope: n=" << n << " r=" << r << " start=" << start << " base=" << opt.base
              << " check_finite=" << opt.check_finite << " padded=" << padded
              << " invalid=" << ex.invalid << " non_finite=" << ex.flags.non_finite
              << " may_overflow=" << ex.flags.extreme << "\nx=\n"
              << x << "\n";
  c.x = x;
  c.start = start;
  c.n = n;
  c.r = r;
  c.opt = opt;
  c.padded = padded;
  c.ex = ex;
  return true;
}

/// Step 3, all forms of one direction (sign +1: apply, -1: backward) on x; the value form's
/// result in `out`.
template <class T>
fz::Outcome rope_forms(const RopeCase<T>& c, double sign, Matrix<T>& out) {
  namespace rope = mixattn::rope;
  const Matrix<T>& x = c.x;
  const Index start = c.start, n = c.n, r = c.r;
  const mixattn::rope::Options& opt = c.opt;
  const bool padded = c.padded;
  const fz::Expect& ex = c.ex;
  const fz::Strided<T> xs = fz::strided(x, padded);
  const bool fwd = sign > 0;
  const fz::Outcome o = fz::run(ex, [&] {
    out = fwd ? rope::apply<T>(xs.view(), start, opt) : rope::backward<T>(xs.view(), start, opt);
  });
  MIXATTN_FUZZ_CHECK(fz::same_bits(xs.view(), x), "rope wrote through its input");
  if (o == fz::Outcome::returned) fz::check_result(out, n, r, ex.must_be_finite(), "rope output");
  Matrix<T> into;
  const fz::Outcome o_into = fz::run(ex, [&] {
    if (fwd)
      rope::apply_into<T>(into, xs.view(), start, opt);
    else
      rope::backward_into<T>(into, xs.view(), start, opt);
  });
  MIXATTN_FUZZ_CHECK(o_into == o, "rope _into and value forms disagree on the outcome");
  if (o == fz::Outcome::returned)
    MIXATTN_FUZZ_CHECK(fz::same_bits(into, out), "rope _into and value forms disagree");
  Matrix<T> self = x;  // _into onto its own input
  const fz::Outcome o_self = fz::run(ex, [&] {
    if (fwd)
      rope::apply_into<T>(self, self, start, opt);
    else
      rope::backward_into<T>(self, self, start, opt);
  });
  MIXATTN_FUZZ_CHECK(o_self == o, "rope _into onto its input disagrees on the outcome");
  if (o == fz::Outcome::returned)
    MIXATTN_FUZZ_CHECK(fz::same_bits(self, out), "rope _into onto its input disagrees");
  fz::Strided<T> block = fz::strided(x, padded);  // in place on a row block of a wider buffer
  const Matrix<T> buffer_before = block.buffer;
  const fz::Outcome o_place = fz::run(ex, [&] {
    auto view = block.buffer.block(0, block.offset, n, r);
    if (fwd)
      rope::apply_in_place<T>(view, start, opt);
    else
      rope::backward_in_place<T>(view, start, opt);
  });
  MIXATTN_FUZZ_CHECK(o_place == o, "rope in place disagrees on the outcome");
  if (o_place == fz::Outcome::invalid_argument)  // validation happens before any write
    MIXATTN_FUZZ_CHECK(fz::same_bits(block.buffer, buffer_before), "refused rope wrote");
  for (Index row = 0; row < n; ++row)
    for (Index j = 0; j < block.buffer.cols(); ++j)
      if (j < block.offset || j >= block.offset + r)
        MIXATTN_FUZZ_CHECK(
            fz::same_bits(block.buffer.block(row, j, 1, 1), buffer_before.block(row, j, 1, 1)),
            "rope in place wrote outside its block");
  if (o == fz::Outcome::returned)
    MIXATTN_FUZZ_CHECK(fz::same_bits(block.view(), out), "rope in place disagrees");
  return o;
}

/// Step 4, the forms against the long double twin, and backward(apply(x)) against x.
template <class T>
void rope_bounds(const RopeCase<T>& c, const Matrix<T>& y, const Matrix<T>& g) {
  namespace rope = mixattn::rope;
  const Matrix<T>& x = c.x;
  const Index start = c.start, n = c.n, r = c.r;
  const mixattn::rope::Options& opt = c.opt;
  const fz::Expect& ex = c.ex;
  for (Index row = 0; row < n; ++row) {
    const double p = position(start, row);
    for (Index i = 0; 2 * i + 1 < r; ++i) {
      const long double x0 = x(row, 2 * i), x1 = x(row, 2 * i + 1);
      long double w0, w1;
      twin_pair(opt.base, r, i, p, 1.0, x0, x1, w0, w1);
      MIXATTN_FUZZ_CHECK(close_pair<T>(w0, y(row, 2 * i), x0, x1, 2) &&
                             close_pair<T>(w1, y(row, 2 * i + 1), x0, x1, 2),
                         "rope::apply differs from the twin");
      twin_pair(opt.base, r, i, p, -1.0, x0, x1, w0, w1);
      MIXATTN_FUZZ_CHECK(close_pair<T>(w0, g(row, 2 * i), x0, x1, 2) &&
                             close_pair<T>(w1, g(row, 2 * i + 1), x0, x1, 2),
                         "rope::backward differs from the twin");
    }
  }
  // The rotation is orthogonal: backward(apply(x)) = x up to the two roundings. The second
  // rotation turns apply's error (within close_pair's bound of |x0| + |x1|) without growing its
  // norm and adds its own on |y0| + |y1| <= sqrt(2) (|x0| + |x1|): slack 2 (1 + 1 + sqrt(2)) < 7.
  if (ex.flags.extreme) return;  // y may sit at the edge of T, where a second rotation overflows
  Matrix<T> z;
  const fz::Outcome oz = fz::run(ex, [&] { z = rope::backward<T>(y, start, opt); });
  MIXATTN_FUZZ_CHECK(oz == fz::Outcome::returned, "rope::backward of apply's result threw");
  for (Index row = 0; row < n; ++row)
    for (Index j = 0; j + 1 < r; j += 2) {
      const long double x0 = x(row, j), x1 = x(row, j + 1);
      MIXATTN_FUZZ_CHECK(
          close_pair<T>(x0, z(row, j), x0, x1, 7) && close_pair<T>(x1, z(row, j + 1), x0, x1, 7),
          "rope::backward(apply(x)) is not x");
    }
}

/// RoPE on the drawn q, decoded from bytes after everything softmax_case reads, so that the seed
/// corpus decodes as it did before (an input that ends earlier reads 0 here: no RoPE). x is q
/// itself (odd r must be refused), q less one column (parity flipped, possibly none at all), or q
/// tiled 2 to 8 times (widths up to 128, where a tiny base makes theta_i = base^(-2i/r) huge).
/// start: 0, small, negative, near 2^31, 2^53, 2^62, or the ends of Index (where start + N - 1 no
/// longer exists); base: the default, ordinary, tiny (down to denorm_min), huge, and invalid
/// (0, negative, NaN, Inf). Every form (value, _into fresh, _into onto its own input, in place
/// on a row block of a wider buffer) of apply and backward is held to fz::run's oracle and to
/// the value form's bits; valid finite results to the twin; backward(apply(x)) to x.
template <class T>
void rope_case(fz::Bytes& in, const Matrix<T>& q) {
  RopeCase<T> c;
  if (!decode_rope(in, q, c)) return;
  Matrix<T> y, g;
  const fz::Outcome oy = rope_forms(c, 1.0, y), og = rope_forms(c, -1.0, g);
  if (c.ex.flags.non_finite || oy != fz::Outcome::returned || og != fz::Outcome::returned) return;
  if (!y.allFinite() || !g.allFinite()) return;  // an overflow, checks off: nothing to compare
  rope_bounds(c, y, g);
}

template <class T>
void run_case(fz::Bytes& in) {
  Matrix<T> q;
  softmax_case<T>(in, q);
  rope_case<T>(in, q);  // reads only bytes after every one softmax_case reads
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
