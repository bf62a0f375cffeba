// libFuzzer target: reference softmax attention (SPEC §3), naive and flash, forward and backward.
// Decodes shapes (≤ 64 tokens, ≤ 16 dims, sometimes inconsistent), options (scale 0, tiny, huge,
// NaN, Inf; causal with N != M; check_finite on/off; a sliding window, SPEC §7, of 0 or
// 1 ... N + 2 keys when causal, now and then one without causal or a negative one) and values
// (NaN, Inf, huge, tiny, zero and duplicated rows), and holds every call to the oracle in
// fuzz_common.hpp. Where the logits are moderate, naive and flash must also agree.
#include <mixattn/reference.hpp>

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

template <class T>
void run_case(fz::Bytes& in) {
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

  const fz::Strided<T> qs = fz::strided(q, padded), ks = fz::strided(k, padded),
                       vs = fz::strided(v, padded);
  Matrix<T> out[2];
  ref::Saved<T> saved[2];
  bool returned[2] = {false, false};
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
  if (!returned[0] && !returned[1]) return;

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

  // Backward: grad_out of the right shape, or a wrong one, or a Saved from nowhere / the other
  // form.
  fz::Expect bex = ex;
  bex.flags.merge(grad_flags);
  Matrix<T> g = dout;
  const ref::Saved<T> empty;
  Matrix<T> grads[2][3];
  bool back_returned[2] = {false, false};
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

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
