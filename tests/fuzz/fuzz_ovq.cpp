// libFuzzer target: Online Vector-Quantized attention (SPEC §2), forward and backward, streamed
// over up to four calls that carry one State. Decodes options (block, max_centroids, growth,
// alpha, seeding, assignment rule, count bias, gradient mode, norm_eps, check_finite; bad ones
// included), beta, the pieces' lengths and contents (NaN/Inf/huge/tiny/zero/identical rows),
// and sometimes corrupts the state or a piece's shape. Every call is held to the oracle in
// fuzz_common.hpp, and:
//   - a call that throws leaves the State bitwise unchanged, and the Saved it was given too,
//     unless all its inputs were finite and its result overflowed (then it is marked unfilled);
//   - a call that returns leaves a consistent State (centroids <= max_centroids, counts >= 1,
//     pending rows = tokens_seen mod block, centroid keys inside the unit ball);
//   - for moderate double inputs, the streamed outputs and final state match one call over the
//     concatenated sequence (SPEC 2.5);
//   - with existing-only assignment, no token joins a centroid its own block opened.
#include <mixattn/ovq.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
namespace ovq = mixattn::ovq;
namespace fz = mixattn::fuzz;

using fz::magnitude_product;
using fz::max_abs;

template <class T>
bool same_state(const ovq::State<T>& a, const ovq::State<T>& b) {
  return fz::same_bits(a.keys, b.keys) && fz::same_bits(a.values, b.values) &&
         fz::same_bits(a.counts, b.counts) && fz::same_bits(a.pending_keys, b.pending_keys) &&
         fz::same_bits(a.pending_values, b.pending_values) && a.tokens_seen == b.tokens_seen;
}

template <class T>
bool same_saved(const ovq::Saved<T>& a, const ovq::Saved<T>& b) {
  return same_state(a.start, b.start) && a.assignment == b.assignment && a.seeds == b.seeds &&
         a.new_centroids == b.new_centroids && a.tokens == b.tokens &&
         std::memcmp(&a.beta, &b.beta, sizeof(T)) == 0 && a.block == b.block &&
         a.count_bias == b.count_bias && a.norm_eps == b.norm_eps && a.recorded == b.recorded;
}

template <class T>
void check_state_invariants(const ovq::State<T>& s, const ovq::Options& opt, Index r, Index dv,
                            bool finite) {
  const Index n = s.keys.rows();
  MIXATTN_FUZZ_CHECK(s.keys.cols() == r && s.values.cols() == dv && s.values.rows() == n &&
                         s.counts.size() == n,
                     "state shapes disagree");
  MIXATTN_FUZZ_CHECK(n <= opt.max_centroids, "more centroids than max_centroids");
  MIXATTN_FUZZ_CHECK(s.pending_keys.rows() == s.tokens_seen % opt.block &&
                         s.pending_values.rows() == s.pending_keys.rows(),
                     "pending rows disagree with tokens_seen");
  for (Index i = 0; i < n; ++i) MIXATTN_FUZZ_CHECK(s.counts[i] >= T(1), "count below 1");
  if (finite) {
    MIXATTN_FUZZ_CHECK(s.keys.allFinite() && s.values.allFinite() && s.counts.allFinite(),
                       "non-finite state from finite input");
    // Running means of vectors of norm < 1 stay inside the unit ball (a few ulps of slack).
    for (Index i = 0; i < n; ++i)
      MIXATTN_FUZZ_CHECK(s.keys.row(i).norm() <= T(1) + T(1e-3), "centroid key outside unit ball");
  }
}

/// Existing-only assignment (SPEC 2.3 step 3), read off the record: a block's seeds open its new
/// rows, and every other token joined a row that existed before the block, or row 0 when the
/// block started from an empty dictionary.
template <class T>
void check_existing_only(const ovq::Saved<T>& saved) {
  Index rows = saved.start.keys.rows(), first_seed = 0;
  for (std::size_t u = 0; u < saved.new_centroids.size(); ++u) {
    const Index nu = saved.new_centroids[u], b0 = static_cast<Index>(u) * saved.block;
    for (Index j = b0; j < b0 + saved.block; ++j) {
      Index pick = -1;
      for (Index p = 0; p < nu; ++p)
        if (saved.seeds[static_cast<std::size_t>(first_seed + p)] == j) pick = p;
      const Index a = saved.assignment[static_cast<std::size_t>(j)];
      MIXATTN_FUZZ_CHECK(pick >= 0 ? a == rows + pick : (rows > 0 ? a < rows : a == 0),
                         "existing-only: a token joined a centroid its block opened");
    }
    rows += nu;
    first_seed += nu;
  }
}

/// One stream of up to four calls carrying one State: its options (decoded first) and what the
/// accepted calls left for the streaming comparison.
template <class T>
struct Stream {
  Index r = 1, dv = 1;
  ovq::Options opt;
  T beta = T(1);
  bool padded = false, bad_options = false, beta_bad = false, beta_extreme = false;
  int calls = 1;
  double s = 0;
  ovq::State<T> state;
  std::vector<Matrix<T>> all_q, all_k, all_v, outs;
  fz::Flags carried;          // what earlier accepted calls left in the state
  bool stream_clean = false;  // every piece valid and moderate
};

/// Step 1, decode: options, beta and the number of calls.
template <class T>
Stream<T> decode_stream(fz::Bytes& in) {
  const bool is_float = std::is_same<T, float>::value;
  const Index r = in.range(1, 16), dv = in.range(1, 16);
  ovq::Options opt;
  static constexpr Index block_menu[] = {1, 2, 3, 4, 5, 8, 16, 64, 0, -3};
  opt.block = in.pick(block_menu);
  static constexpr Index cap_menu[] = {1, 2, 3, 5, 16, 64, 1024, 0};
  opt.max_centroids = in.pick(cap_menu);
  opt.growth = in.flag() ? ovq::Growth::plateau : ovq::Growth::linear;
  static constexpr double alpha_menu[] = {0, 0, 0.5, 1, 100, -1,
                                          std::numeric_limits<double>::quiet_NaN(),
                                          std::numeric_limits<double>::infinity()};
  opt.growth_alpha = in.pick(alpha_menu);
  opt.seeding = in.flag() ? ovq::Seeding::greedy_dispersion : ovq::Seeding::one_shot;
  const std::uint8_t bias_byte = in.u8();
  opt.count_bias = bias_byte % 4 != 0;
  // Bit 3 of the same byte picks the assignment rule: the seed corpus keeps its other options.
  opt.assignment =
      (bias_byte & 8) != 0 ? ovq::Assignment::existing_only : ovq::Assignment::all_centroids;
  opt.grad_through_dictionary = in.u8() % 4 != 0;
  static constexpr double norm_menu[] = {1e-5, 1e-5, 1e-5, 1, 1e-30, 0, -1,
                                         std::numeric_limits<double>::quiet_NaN()};
  opt.norm_eps = in.pick(norm_menu);
  opt.check_finite = in.u8() % 5 != 0;
  static constexpr double beta_menu[] = {1, 1, 1, 0, -2, 0.01, 1e3, 1e30, 1e38,
                                         std::numeric_limits<double>::quiet_NaN(),
                                         std::numeric_limits<double>::infinity()};
  const T beta = static_cast<T>(in.pick(beta_menu));
  const bool padded = in.flag();
  const int calls = static_cast<int>(in.range(1, 4));

  const bool bad_options = opt.block < 1 || opt.max_centroids < 1 || !(opt.growth_alpha >= 0) ||
                           !std::isfinite(opt.growth_alpha) || !(opt.norm_eps > 0) ||
                           !std::isfinite(opt.norm_eps) ||
                           static_cast<double>(beta) <= 0;  // beta must be > 0 (NaN: domain)
  const double s = static_cast<double>(beta) * std::sqrt(static_cast<double>(r));
  const bool beta_bad = !std::isfinite(static_cast<double>(beta)) ||
                        !std::isfinite(static_cast<double>(static_cast<T>(s)));
  // Logits reach |s| (unit vectors) plus log counts: a float s of 4e30 is representable, but it
  // leaves the softmax no room; treat |beta| > 1e6 as extreme.
  const bool beta_extreme = std::abs(static_cast<double>(beta)) > 1e6;
  if (fz::verbose())
    std::cerr << (is_float ? "float" : "double") << " r=" << r << " dv=" << dv
              << " block=" << opt.block << " max_centroids=" << opt.max_centroids
              << " plateau=" << (opt.growth == ovq::Growth::plateau)
              << " alpha=" << opt.growth_alpha
              << " greedy=" << (opt.seeding == ovq::Seeding::greedy_dispersion)
              << " existing_only=" << (opt.assignment == ovq::Assignment::existing_only)
              << " count_bias=" << opt.count_bias << " through=" << opt.grad_through_dictionary
              << " norm_eps=" << opt.norm_eps << " check_finite=" << opt.check_finite
              << " beta=" << beta << " calls=" << calls << "\n";
  Stream<T> out;
  out.r = r;
  out.dv = dv;
  out.opt = opt;
  out.beta = beta;
  out.padded = padded;
  out.calls = calls;
  out.bad_options = bad_options;
  out.beta_bad = beta_bad;
  out.beta_extreme = beta_extreme;
  out.s = s;
  out.state = ovq::State<T>::empty(r, dv);
  out.stream_clean = !bad_options && !beta_bad && !beta_extreme;
  return out;
}

/// One call of the stream: its inputs, what the oracle expects, and the state it is handed (the
/// stream's own, or a copy that breaks an invariant).
template <class T>
struct Piece {
  Index tn = 0;
  Matrix<T> q, k, v, dout;
  fz::Flags grad_flags;
  std::uint8_t backward_mode = 0;
  fz::Expect cex;
  ovq::State<T> broken;
  bool use_broken = false;
};

/// Step 2, decode one call: shapes (sometimes corrupted), inputs, and a state to hand it.
template <class T>
Piece<T> decode_piece(fz::Bytes& in, const Stream<T>& stream, int call) {
  const Index r = stream.r, dv = stream.dv;
  const ovq::Options& opt = stream.opt;
  const T beta = stream.beta;
  const bool bad_options = stream.bad_options, beta_bad = stream.beta_bad,
             beta_extreme = stream.beta_extreme;
  const fz::Flags& carried = stream.carried;
  const ovq::State<T>& state = stream.state;
  const Index tn = in.range(0, 40);
  Index qr = r, kr = r, vc = dv, krows = tn;
  const std::uint8_t corrupt = in.u8();
  switch (corrupt % 16) {
    case 0: qr = r + 1; break;
    case 1: kr = r + 1; break;
    case 2: vc = dv + 1; break;
    case 3: krows = tn + 1; break;
    default: break;
  }
  fz::Expect ex;
  ex.check_finite = opt.check_finite;
  ex.invalid = bad_options || qr != r || kr != r || vc != dv || krows != tn;
  const Matrix<T> q = fz::matrix<T>(in, tn, qr, ex.flags);
  const Matrix<T> k = fz::matrix<T>(in, krows, kr, ex.flags);
  const Matrix<T> v = fz::matrix<T>(in, krows, vc, ex.flags);
  fz::Flags grad_flags;
  const Matrix<T> dout = fz::matrix<T>(in, tn, dv, grad_flags);
  const std::uint8_t backward_mode = in.u8();
  // Hostile tokens an unchecked call accepted live on in the state (pending rows, centroids).
  ex.flags.merge(carried);
  if (!std::isfinite(static_cast<double>(beta))) ex.flags.non_finite = true;
  else if (beta_bad || beta_extreme) ex.flags.extreme = true;

  // Sometimes hand the call a state that breaks an invariant (on a copy: the stream goes on).
  ovq::State<T> broken = state;
  const ovq::State<T>* st = &state;
  fz::Expect cex = ex;
  const std::uint8_t state_mode = in.u8();
  if (state_mode % 16 == 0 && broken.counts.size() > 0) {
    broken.counts[0] = T(0);
    st = &broken;
    cex.invalid = true;
  } else if (state_mode % 16 == 1 && opt.block > 1) {
    broken.tokens_seen += 1;  // no longer matches the pending rows (with block 1 it would)
    st = &broken;
    cex.invalid = true;
  } else if (state_mode % 16 == 2 && broken.keys.rows() > 0) {
    broken.keys(0, 0) = std::numeric_limits<T>::quiet_NaN();
    st = &broken;
    cex.flags.non_finite = true;
  } else if (state_mode % 16 == 3) {
    broken.values.conservativeResize(broken.values.rows() + 1, Eigen::NoChange);
    broken.values.bottomRows(1).setZero();
    st = &broken;
    cex.invalid = true;
  }

  if (fz::verbose())
    std::cerr << "call " << call << ": tn=" << tn << " qr=" << qr << " kr=" << kr
              << " vc=" << vc << " krows=" << krows << " state_mode=" << int(state_mode % 16)
              << " backward_mode=" << int(backward_mode % 10) << " invalid=" << cex.invalid
              << " non_finite=" << cex.flags.non_finite << " extreme=" << cex.flags.extreme
              << " max_abs=" << cex.flags.max_abs << " centroids=" << state.keys.rows()
              << " pending=" << state.pending_keys.rows() << "\nq=\n" << q << "\nk=\n" << k
              << "\nv=\n" << v << "\n";
  Piece<T> p;
  p.tn = tn;
  p.q = q;
  p.k = k;
  p.v = v;
  p.dout = dout;
  p.grad_flags = grad_flags;
  p.backward_mode = backward_mode;
  p.cex = cex;
  p.use_broken = st != &state;
  p.broken = std::move(broken);
  return p;
}

/// Step 3, forward: the oracle's exception half, the state and saved after a throw, and after a
/// return the state's invariants and the convex hull; records the call for the streaming check.
/// Returns whether the backward should run.
template <class T>
bool forward_piece(Stream<T>& stream, Piece<T>& p, const fz::Strided<T>& qs,
                   const fz::Strided<T>& ks, const fz::Strided<T>& vs, ovq::Saved<T>& saved) {
  const Index r = stream.r, dv = stream.dv, tn = p.tn;
  const ovq::Options& opt = stream.opt;
  const T beta = stream.beta;
  const Matrix<T>&q = p.q, &k = p.k, &v = p.v;
  const fz::Expect& cex = p.cex;
  ovq::State<T>& state = stream.state;
  ovq::State<T>* st = p.use_broken ? &p.broken : &state;
  const ovq::State<T> before = *st;
  saved.tokens = 12345;  // a recognisable Saved must survive a throwing call untouched
  saved.recorded = true;  // marked filled: an overflow must unmark it, other throws keep it
  const ovq::Saved<T> saved_before = saved;
  Matrix<T> out;
  const fz::Outcome o = fz::run(cex, [&] {
    out = ovq::forward(qs.view(), ks.view(), vs.view(), beta, opt, *st, &saved);
  });
  MIXATTN_FUZZ_CHECK(fz::same_bits(qs.view(), q) && fz::same_bits(ks.view(), k) &&
                         fz::same_bits(vs.view(), v),
                     "forward wrote through an input");
  if (o != fz::Outcome::returned) {
    MIXATTN_FUZZ_CHECK(same_state(*st, before), "a throwing call changed the state");
    // README, Errors: a throw for a bad argument or a non-finite input (q, k, v, beta or the
    // state) leaves saved bitwise as it was; only a domain_error from finite inputs and valid
    // arguments (a result that overflowed) may leave it, and then only marked unfilled.
    const bool overflowed =
        o == fz::Outcome::domain_error && !cex.invalid && !cex.flags.non_finite;
    if (overflowed)
      MIXATTN_FUZZ_CHECK(same_saved(saved, saved_before) || !saved.recorded,
                         "an overflowing forward left saved marked filled");
    else
      MIXATTN_FUZZ_CHECK(same_saved(saved, saved_before), "a throwing call changed saved");
    return false;
  }
  if (opt.assignment == ovq::Assignment::existing_only) check_existing_only(saved);
  if (st != &state) return false;  // a corrupted copy that was accepted (non-finite, unchecked)
  // A throwing call changes nothing; a returning one with hostile content ends the comparison.
  if (!cex.must_be_finite() || cex.flags.extreme) stream.stream_clean = false;
  stream.carried.merge(cex.flags);
  fz::check_result(out, tn, dv, cex.must_be_finite(), "forward output");
  check_state_invariants(state, opt, r, dv, cex.must_be_finite());
  MIXATTN_FUZZ_CHECK(state.tokens_seen == before.tokens_seen + tn, "tokens_seen not advanced");
  // Outputs are convex combinations of value rows, pending values and centroid values.
  if (cex.must_be_finite() && tn > 0)
    MIXATTN_FUZZ_CHECK(
        max_abs(out) <= std::max({max_abs(v), max_abs(before.values),
                                  max_abs(before.pending_values)}) * (1 + 1e-4) + 1e-30,
        "output outside the convex hull of the values");
  stream.all_q.push_back(q);
  stream.all_k.push_back(k);
  stream.all_v.push_back(v);
  stream.outs.push_back(out);
  return true;
}

/// Step 4, backward of the call: the same record with a mutation (grad_out's shape, the block,
/// beta) or another gradient mode; finite gradients where the inputs are bounded.
template <class T>
void backward_piece(const Stream<T>& stream, const Piece<T>& p, const fz::Strided<T>& qs,
                    const fz::Strided<T>& ks, const fz::Strided<T>& vs,
                    const ovq::Saved<T>& saved) {
  const bool is_float = std::is_same<T, float>::value;
  const Index r = stream.r, dv = stream.dv, tn = p.tn;
  const ovq::Options& opt = stream.opt;
  const T beta = stream.beta;
  const double s = stream.s;
  const bool padded = stream.padded;
  const Matrix<T>&q = p.q, &k = p.k, &v = p.v, &dout = p.dout;
  const fz::Expect& cex = p.cex;
  const fz::Flags& grad_flags = p.grad_flags;
  const std::uint8_t backward_mode = p.backward_mode;
  // Backward of this call.
  fz::Expect bex = cex;
  bex.flags.merge(grad_flags);
  bex.unchecked_nan_may_reject = true;
  // Each gradient is a sum over at most tn + 1 queries of terms bounded by
  // 2 s max|v| max|grad_out| / (|x| + norm_eps) (the normalisation's Jacobian is at most
  // 1 / norm_eps, reached by a zero row): a tiny norm_eps can overflow the gradients of finite,
  // moderate inputs, which the backward reports as std::domain_error.
  const double grad_bound =
      magnitude_product({2 * static_cast<double>(tn + 1) * std::abs(s) / opt.norm_eps,
                         bex.flags.max_abs, bex.flags.max_abs});
  if (!(grad_bound < (is_float ? 1e36 : 1e300))) bex.flags.extreme = true;
  Matrix<T> g = dout;
  ovq::Options bopt = opt;
  T bbeta = beta;
  switch (backward_mode % 10) {
    case 0: g = Matrix<T>::Zero(tn + 1, dv); bex.invalid = true; break;
    case 1: bopt.block = opt.block + 1; bex.invalid = true; break;
    case 2: bbeta = beta + T(1) == beta ? T(0) : beta + T(1); bex.invalid = true; break;
    default: bopt.grad_through_dictionary = (backward_mode & 16) != 0; break;
  }
  const fz::Strided<T> gs = fz::strided(g, padded);
  ovq::Grad<T> grad;
  const fz::Outcome bo = fz::run(bex, [&] {
    grad = ovq::backward(qs.view(), ks.view(), vs.view(), bbeta, gs.view(), saved, bopt);
  });
  MIXATTN_FUZZ_CHECK(fz::same_bits(qs.view(), q) && fz::same_bits(ks.view(), k) &&
                         fz::same_bits(vs.view(), v) && fz::same_bits(gs.view(), g),
                     "backward wrote through an input");
  if (bo != fz::Outcome::returned) return;
  // Gradients scale with s, |v| and 1 / (|x| + norm_eps): finite for |x| <= 1e4,
  // |beta| <= 1e3 and norm_eps >= 1e-5; beyond, with checks on, overflow is a domain_error.
  const bool finite = bex.must_be_finite() &&
                      (opt.check_finite || (bex.flags.max_abs <= 1e4 &&
                                            std::abs(static_cast<double>(beta)) <= 1e3 &&
                                            opt.norm_eps >= 1e-5));
  fz::check_result(grad.q, tn, r, finite, "grad q");
  fz::check_result(grad.k, tn, r, finite, "grad k");
  fz::check_result(grad.v, tn, dv, finite, "grad v");
  if (finite) MIXATTN_FUZZ_CHECK(std::isfinite(static_cast<double>(grad.beta)), "grad beta");
}

/// Step 5, streaming (SPEC 2.5): for moderate double inputs, one call over the concatenated
/// sequence gives the streamed outputs and final state.
template <class T>
void check_streaming(const Stream<T>& stream) {
  const bool is_float = std::is_same<T, float>::value;
  const Index r = stream.r, dv = stream.dv;
  const ovq::Options& opt = stream.opt;
  const T beta = stream.beta;
  const ovq::State<T>& state = stream.state;
  const std::vector<Matrix<T>>&all_q = stream.all_q, &all_k = stream.all_k,
                              &all_v = stream.all_v, &outs = stream.outs;
  const bool stream_clean = stream.stream_clean;
  // Streaming (SPEC 2.5): the same tokens in one call give the same outputs and final state.
  if (!stream_clean || is_float || all_q.empty()) return;
  Index total = 0;
  double vmax = 0, xmax = 0;
  for (std::size_t i = 0; i < all_q.size(); ++i) {
    total += all_q[i].rows();
    vmax = std::max(vmax, max_abs(all_v[i]));
    xmax = std::max({xmax, max_abs(all_q[i]), max_abs(all_k[i])});
  }
  if (xmax > 1e4 || vmax > 1e4) return;
  Matrix<T> q(total, r), k(total, r), v(total, dv), expect(total, dv);
  Index row = 0;
  for (std::size_t i = 0; i < all_q.size(); ++i) {
    const Index t = all_q[i].rows();
    q.middleRows(row, t) = all_q[i];
    k.middleRows(row, t) = all_k[i];
    v.middleRows(row, t) = all_v[i];
    expect.middleRows(row, t) = outs[i];
    row += t;
  }
  ovq::State<T> one = ovq::State<T>::empty(r, dv);
  const Matrix<T> got = ovq::forward<T>(q, k, v, beta, opt, one);
  MIXATTN_FUZZ_CHECK(fz::same_bits(one.counts, state.counts) && one.tokens_seen == state.tokens_seen,
                     "streamed and one-call states differ in counts");
  MIXATTN_FUZZ_CHECK(max_abs(one.keys - state.keys) <= 1e-12 &&
                         max_abs(one.values - state.values) <= 1e-12 * (vmax + 1e-300),
                     "streamed and one-call dictionaries differ");
  MIXATTN_FUZZ_CHECK(max_abs(got - expect) <= 1e-10 * (vmax + 1e-300),
                     "streamed and one-call outputs differ");
}

template <class T>
void run_case(fz::Bytes& in) {
  Stream<T> stream = decode_stream<T>(in);
  for (int call = 0; call < stream.calls; ++call) {
    Piece<T> p = decode_piece(in, stream, call);
    const fz::Strided<T> qs = fz::strided(p.q, stream.padded), ks = fz::strided(p.k, stream.padded),
                         vs = fz::strided(p.v, stream.padded);
    ovq::Saved<T> saved;
    if (forward_piece(stream, p, qs, ks, vs, saved)) backward_piece(stream, p, qs, ks, vs, saved);
  }
  check_streaming(stream);
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
