// libFuzzer target: Mamba2's SSD layer (ssd.hpp, SPEC §10) and its state continued over pieces
// (10.2) and through the backward (10.3). Decodes d_head, d_state <= 8, a sequence of <= 48 tokens
// (NaN/Inf/huge/tiny/zero/duplicate rows), the raw steps dt (mapped into the domain or raw), A
// and D (from a menu or hostile), options (chunk, dt_bias, dt_softplus, keep_states,
// check_finite), an optional start state, a cut into up to 5 pieces (empty ones included), the
// form (value or _into) and a mismatch to inject. Every call is held to the oracle in
// fuzz_common.hpp, and:
//   - A > 0, or without the softplus dt + dt_bias < 0, throw std::domain_error whatever
//     check_finite says;
//   - a forward that throws leaves the State bitwise unchanged;
//   - for moderate inputs the pieces' outputs and end state equal one call's, and so does
//     decoding token by token;
//   - the pieces' backwards run in reverse, each fed its successor's grad.state, give finite
//     gradients, and in double equal one call's backward;
//   - a state of another shape, chunk 0, dt of another length, a record given other data, a
//     grad_state_out of another state, or one given to a record of a forward without a State
//     are refused with std::invalid_argument naming the argument.
#include <mixattn/ssd.hpp>

#include "fuzz_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
namespace ssd = mixattn::ssd;
namespace fz = mixattn::fuzz;

using fz::max_abs;

template <class T>
using Wide = mixattn::detail::wide_t<T>;

/// One decoded case: the sequence, its steps and scalars, the start state, the cut and what to
/// inject.
template <class T>
struct Case {
  ssd::Options opt;
  Matrix<T> x, B, C, dout;
  Vector<T> dt;
  T A = 0, D = 0;
  Matrix<Wide<T>> h0;  // S x P (zero without a start state)
  std::vector<Index> cuts;
  fz::Expect ex;  // of the whole sequence
  fz::Flags grad_flags;
  bool out_of_domain = false;  // A > 0, or a negative step without the softplus
  bool into = false;
  std::uint8_t mismatch = 0;
  double terms = 0;  // a bound on the magnitude of every term the forward sums (moderate only)
  Index n() const { return x.rows(); }
  Index P() const { return x.cols(); }
  Index S() const { return B.cols(); }
};

/// The flags of rows [0, end) of x, dt, B, C, of A, D and of the start state: what a piece
/// ending at `end` has read, through the state it continues.
template <class T>
fz::Flags prefix_flags(const Case<T>& c, Index end) {
  fz::Flags f;
  const auto add = [&f](const auto& m) {
    for (Index i = 0; i < m.rows(); ++i)
      for (Index j = 0; j < m.cols(); ++j) fz::classify<T>(static_cast<double>(m(i, j)), f);
  };
  add(c.x.topRows(end));
  add(c.dt.head(end));
  add(c.B.topRows(end));
  add(c.C.topRows(end));
  add(c.h0.template cast<T>());
  fz::classify<T>(static_cast<double>(c.A), f);
  fz::classify<T>(static_cast<double>(c.D), f);
  return f;
}

/// The largest step Delta of the case (SPEC 10.1), in double.
template <class T>
double max_step(const Case<T>& c) {
  double m = 0;
  for (Index t = 0; t < c.n(); ++t) {
    const double z = static_cast<double>(c.dt(t)) + c.opt.dt_bias;
    m = std::max(
        m, c.opt.dt_softplus ? std::max(z, 0.0) + std::log1p(std::exp(-std::abs(z))) : std::abs(z));
  }
  return m;
}

/// A bound on every term of the forward's sums: (|h0| + n |B| |Delta| |x|) S |C| + |D| |x|, times
/// the gradient's extra factors (n |dY| (1 + |A|) (S + P)) for the backward. A case whose bound
/// comes near T's range is treated as extreme (products may overflow).
template <class T>
void bound_terms(Case<T>& c) {
  const double n = static_cast<double>(c.n() + 1), s = static_cast<double>(c.S() + c.P());
  const double state = max_abs(c.h0) + n * max_abs(c.B) * max_step(c) * max_abs(c.x) + 1;
  const double fwd =
      state * s * (max_abs(c.C) + 1) + std::abs(static_cast<double>(c.D)) * max_abs(c.x);
  c.terms = fwd * n * s * (1 + std::abs(static_cast<double>(c.A))) * (max_abs(c.x) + 1) *
            (max_abs(c.B) + max_abs(c.C) + max_step(c) + 1);
  const double limit = 1e-6 * static_cast<double>(std::numeric_limits<T>::max());
  if (!(fwd <= limit)) c.ex.flags.extreme = true;
}

template <class T>
Case<T> decode(fz::Bytes& in) {
  Case<T> c;
  const Index P = in.range(1, 8), S = in.range(1, 8), n = in.range(0, 48);
  static constexpr Index chunk_menu[] = {64, 1, 2, 3, 5, 16};
  c.opt.chunk = in.pick(chunk_menu);
  static constexpr double bias_menu[] = {0, 0, 1, -2};
  c.opt.dt_bias = in.pick(bias_menu);
  c.opt.dt_softplus = in.u8() % 4 != 0;
  c.opt.keep_states = in.flag();
  c.opt.check_finite = in.u8() % 5 != 0;
  const bool with_state = in.flag();
  const bool raw = in.u8() % 8 == 0;  // dt, A and D as decoded, out of their domains too
  c.into = in.flag();
  c.mismatch = in.u8();
  c.ex.check_finite = c.opt.check_finite;
  static constexpr double a_menu[] = {-1, -0.5, -3, 0, -1e-3, -20, -1, -0.1};
  static constexpr double d_menu[] = {1, 0, -0.5, 2};
  c.A = raw ? fz::special_value<T>(in.u8()) : static_cast<T>(in.pick(a_menu));
  c.D = raw ? fz::special_value<T>(in.u8()) : static_cast<T>(in.pick(d_menu));
  fz::Flags ignored;  // every input is classified as the operator sees it (prefix_flags)
  c.x = fz::matrix<T>(in, n, P, ignored);
  c.dt = fz::vector<T>(in, n, ignored);
  c.B = fz::matrix<T>(in, n, S, ignored);
  c.C = fz::matrix<T>(in, n, S, ignored);
  if (!raw && !c.opt.dt_softplus)  // into the domain: dt + dt_bias = |dt| (NaN stays NaN)
    c.dt = (c.dt.cwiseAbs().array() + static_cast<T>(std::max(0.0, -c.opt.dt_bias))).matrix();
  c.out_of_domain = c.A > T(0);
  for (Index t = 0; t < n && !c.opt.dt_softplus; ++t)
    c.out_of_domain |= static_cast<Wide<T>>(c.dt(t)) + static_cast<Wide<T>>(c.opt.dt_bias) < 0;
  c.h0 = Matrix<Wide<T>>::Zero(S, P);
  if (with_state) c.h0 = fz::matrix<T>(in, S, P, ignored).template cast<Wide<T>>();
  c.dout = fz::matrix<T>(in, n, P, c.grad_flags);
  c.cuts = fz::pieces(in, n, 5);
  c.ex.flags = prefix_flags(c, n);
  if (!c.ex.flags.non_finite) bound_terms(c);
  return c;
}

template <class T>
ssd::State<T> start_state(const Case<T>& c) {
  ssd::State<T> st = ssd::State<T>::empty(c.S(), c.P());
  st.h = c.h0;
  return st;
}

/// The injected refusals of a forward: a state of another shape, chunk 0, dt of another length.
template <class T>
void forward_mismatch(const Case<T>& c) {
  ssd::State<T> st = start_state(c);
  ssd::Options opt = c.opt;
  const Vector<T> longer = Vector<T>::Ones(c.n() + 1);
  switch (c.mismatch % 8) {
    case 1:  // the state is checked after the inputs, whose values may throw first
      if (c.out_of_domain || (c.opt.check_finite && c.ex.flags.non_finite)) break;
      st = ssd::State<T>::empty(c.S() + 1, c.P());
      fz::expect_invalid_naming(
          "state", [&] { ssd::forward<T>(c.x, c.dt, c.A, c.B, c.C, c.D, opt, &st); },
          "a state of another shape");
      break;
    case 2:
      opt.chunk = 0;
      fz::expect_invalid_naming(
          "chunk", [&] { ssd::forward<T>(c.x, c.dt, c.A, c.B, c.C, c.D, opt, &st); }, "chunk 0");
      break;
    case 3:
      fz::expect_invalid_naming(
          "dt has", [&] { ssd::forward<T>(c.x, longer, c.A, c.B, c.C, c.D, opt, &st); },
          "dt of another length");
      break;
    default:
      break;
  }
}

/// The forward over the pieces, each with its own record, the state carried; false when a piece
/// threw (the state then unchanged).
template <class T>
bool forward_pieces(const Case<T>& c, Matrix<T>& out, std::vector<ssd::Saved<T>>& saved,
                    ssd::State<T>& st) {
  out.resize(c.n(), c.P());
  saved.resize(c.cuts.size());
  st = start_state(c);
  Index row0 = 0;
  for (std::size_t p = 0; p < c.cuts.size(); ++p) {
    const Index len = c.cuts[p];
    fz::Expect pex = c.ex;
    pex.flags = prefix_flags(c, row0 + len);
    pex.flags.extreme |= c.ex.flags.extreme;
    const ssd::State<T> before = st;
    Matrix<T> o;
    const fz::Outcome r = fz::run(pex, [&] {
      const auto x = c.x.middleRows(row0, len), B = c.B.middleRows(row0, len);
      const auto C = c.C.middleRows(row0, len);
      const auto dt = c.dt.segment(row0, len);
      if (c.into)
        ssd::forward_into<T>(o, x, dt, c.A, B, C, c.D, c.opt, &st, &saved[p]);
      else
        o = ssd::forward<T>(x, dt, c.A, B, C, c.D, c.opt, &st, &saved[p]);
    });
    if (r != fz::Outcome::returned) {
      MIXATTN_FUZZ_CHECK(fz::same_bits(st.h, before.h) && st.tokens_seen == before.tokens_seen,
                         "a forward that threw changed the state");
      return false;
    }
    fz::check_result(o, len, c.P(), pex.must_be_finite(), "piece output");
    out.middleRows(row0, len) = o;
    row0 += len;
  }
  return true;
}

/// The pieces' backwards in reverse, each given its successor's grad.state: the gradients of
/// the whole sequence in `total` (dA, dD and d dt_bias summed); false when one threw.
template <class T>
bool backward_pieces(const Case<T>& c, const std::vector<ssd::Saved<T>>& saved, ssd::Grad<T>& total,
                     const fz::Expect& bex) {
  total.x.resize(c.n(), c.P());
  total.B.resize(c.n(), c.S());
  total.C.resize(c.n(), c.S());
  total.dt.resize(c.n());
  total.A = total.D = total.dt_bias = T(0);
  ssd::Grad<T> g;
  Index row0 = c.n();
  bool carried = false;  // a non-finite grad_out of a later piece, carried by grad.state
  for (std::size_t p = c.cuts.size(); p-- > 0;) {
    const Index len = c.cuts[p];
    row0 -= len;
    const bool last = p + 1 == c.cuts.size();
    const ssd::StateGrad<T> next = g.state;
    fz::Expect pex = bex;  // x, dt, B, C are finite here; grad_out by piece
    fz::Flags rows;
    const auto d_rows = c.dout.middleRows(row0, len);
    for (Index i = 0; i < d_rows.rows(); ++i)
      for (Index j = 0; j < d_rows.cols(); ++j)
        fz::classify<T>(static_cast<double>(d_rows(i, j)), rows);
    pex.flags.non_finite = rows.non_finite || carried;
    carried = pex.flags.non_finite;
    const fz::Outcome r = fz::run(pex, [&] {
      const auto x = c.x.middleRows(row0, len), B = c.B.middleRows(row0, len);
      const auto C = c.C.middleRows(row0, len), d = c.dout.middleRows(row0, len);
      const auto dt = c.dt.segment(row0, len);
      if (c.into)
        ssd::backward_into<T>(g, x, dt, c.A, B, C, c.D, d, saved[p], c.opt,
                              last ? nullptr : &g.state);
      else
        g = ssd::backward<T>(x, dt, c.A, B, C, c.D, d, saved[p], c.opt, last ? nullptr : &next);
    });
    if (r != fz::Outcome::returned) return false;
    total.x.middleRows(row0, len) = g.x;
    total.B.middleRows(row0, len) = g.B;
    total.C.middleRows(row0, len) = g.C;
    total.dt.segment(row0, len) = g.dt;
    total.A += g.A;
    total.D += g.D;
    total.dt_bias += g.dt_bias;
    MIXATTN_FUZZ_CHECK(g.state.h.rows() == c.S() && g.state.h.cols() == c.P(),
                       "grad.state of the wrong shape");
  }
  total.state = g.state;
  return true;
}

/// The injected refusals of a backward (finite inputs): a record given other data, a
/// grad_state_out of another state, one given to a record of a forward without a State.
template <class T>
void backward_mismatch(const Case<T>& c, const std::vector<ssd::Saved<T>>& saved) {
  std::size_t p = 0;
  Index row0 = 0;
  while (p < c.cuts.size() && c.cuts[p] == 0) ++p;
  if (p == c.cuts.size()) return;  // nothing but empty pieces
  for (std::size_t i = 0; i < p; ++i) row0 += c.cuts[i];
  const Index len = c.cuts[p];
  Matrix<T> x = c.x.middleRows(row0, len);
  const auto B = c.B.middleRows(row0, len), C = c.C.middleRows(row0, len);
  const auto d = c.dout.middleRows(row0, len);
  const auto dt = c.dt.segment(row0, len);
  switch (c.mismatch % 8) {
    case 4:
      x(0, 0) = x(0, 0) == T(0) ? T(1) : T(0);
      fz::expect_invalid_naming(
          "x", [&] { ssd::backward<T>(x, dt, c.A, B, C, c.D, d, saved[p], c.opt); }, "other x");
      break;
    case 5: {
      ssd::StateGrad<T> other;
      other.h = Matrix<Wide<T>>::Zero(c.S(), c.P());
      other.state_fingerprint = saved[p].end_fingerprint ^ 1;
      fz::expect_invalid_naming(
          "grad_state_out",
          [&] { ssd::backward<T>(x, dt, c.A, B, C, c.D, d, saved[p], c.opt, &other); },
          "a grad_state_out of another state");
      break;
    }
    case 6: {
      ssd::Saved<T> plain;
      ssd::forward<T>(x, dt, c.A, B, C, c.D, c.opt, nullptr, &plain);
      ssd::StateGrad<T> gs;
      gs.h = Matrix<Wide<T>>::Zero(c.S(), c.P());
      fz::expect_invalid_naming(
          "grad_state_out", [&] { ssd::backward<T>(x, dt, c.A, B, C, c.D, d, plain, c.opt, &gs); },
          "a grad_state_out without a State");
      break;
    }
    default:
      break;
  }
}

/// Pieces and decoding against one call (moderate inputs): the rounding of sums whose terms are
/// bounded by c.terms' forward part.
template <class T>
void check_forward_consistency(const Case<T>& c, const Matrix<T>& out, const ssd::State<T>& st,
                               const Matrix<T>& one, const ssd::State<T>& one_state) {
  const bool is_float = std::is_same<T, float>::value;
  const double n = static_cast<double>(c.n() + 1), s = static_cast<double>(c.S() + c.P());
  const double bound =
      (max_abs(c.h0) + n * max_abs(c.B) * max_step(c) * max_abs(c.x) + 1) * s * (max_abs(c.C) + 1) +
      std::abs(static_cast<double>(c.D)) * max_abs(c.x);
  const double tol = (is_float ? 1e-4 : 1e-10) * bound +
                     16 * n * static_cast<double>(std::numeric_limits<T>::denorm_min());
  MIXATTN_FUZZ_CHECK(max_abs(out - one) <= tol, "pieces differ from one call");
  MIXATTN_FUZZ_CHECK(max_abs(st.h - one_state.h) <= tol, "end states differ");
  ssd::State<T> dec = start_state(c);
  Matrix<T> row;
  for (Index t = 0; t < c.n(); ++t) {
    ssd::forward_into<T>(row, c.x.row(t), c.dt.segment(t, 1), c.A, c.B.row(t), c.C.row(t), c.D,
                         c.opt, &dec, nullptr);
    MIXATTN_FUZZ_CHECK(max_abs(row - one.row(t)) <= tol, "decoding differs from the forward");
  }
}

template <class T>
void run_case(fz::Bytes& in) {
  const bool is_float = std::is_same<T, float>::value;
  const Case<T> c = decode<T>(in);
  forward_mismatch(c);
  if (c.out_of_domain) {  // refused whatever check_finite says, the state untouched
    ssd::State<T> st = start_state(c);
    fz::Expect dex = c.ex;
    dex.flags.non_finite = true;
    dex.check_finite = true;
    const fz::Outcome r =
        fz::run(dex, [&] { ssd::forward<T>(c.x, c.dt, c.A, c.B, c.C, c.D, c.opt, &st); });
    MIXATTN_FUZZ_CHECK(r == fz::Outcome::domain_error, "A or the steps out of their domain");
    MIXATTN_FUZZ_CHECK(fz::same_bits(st.h, c.h0), "a refused forward changed the state");
    return;
  }
  Matrix<T> out;
  std::vector<ssd::Saved<T>> saved;
  ssd::State<T> st;
  if (!forward_pieces(c, out, saved, st)) return;
  if (!c.ex.must_be_finite() || c.ex.flags.extreme)
    return;  // hostile: the refusals were the oracle
  ssd::State<T> one_state = start_state(c);
  ssd::Saved<T> one_saved;
  const Matrix<T> one =
      ssd::forward<T>(c.x, c.dt, c.A, c.B, c.C, c.D, c.opt, &one_state, &one_saved);
  const bool moderate = c.ex.flags.max_abs <= 1e4;
  if (moderate) check_forward_consistency(c, out, st, one, one_state);
  fz::Expect bex = c.ex;
  bex.flags.merge(c.grad_flags);
  const double limit = 1e-6 * static_cast<double>(std::numeric_limits<T>::max());
  const bool bounded = moderate && !c.grad_flags.non_finite && c.grad_flags.max_abs <= 1e4 &&
                       c.terms * (c.grad_flags.max_abs + 1) <= limit;
  if (bounded) backward_mismatch(c, saved);
  if (!bounded) bex.flags.extreme = true;
  ssd::Grad<T> chained;
  if (!backward_pieces(c, saved, chained, bex)) return;
  const bool finite = bounded || (c.opt.check_finite && !bex.flags.non_finite);
  fz::check_result(chained.x, c.n(), c.P(), finite, "chained grad x");
  fz::check_result(chained.B, c.n(), c.S(), finite, "chained grad B");
  fz::check_result(chained.C, c.n(), c.S(), finite, "chained grad C");
  fz::check_result(chained.dt, c.n(), 1, finite, "chained grad dt");
  fz::check_result(chained.state.h, c.S(), c.P(), finite, "chained grad state");
  // Compared in double only: the rounding of sums whose terms are bounded by c.terms |dY|.
  if (is_float || !bounded) return;
  const ssd::Grad<T> whole =
      ssd::backward<T>(c.x, c.dt, c.A, c.B, c.C, c.D, c.dout, one_saved, c.opt);
  const double tol = 1e-11 * c.terms * (c.grad_flags.max_abs + 1) + 1e-300;
  const auto close = [tol](const auto& x, const auto& y) { return max_abs(x - y) <= tol; };
  const Eigen::Vector3d sc_chained(chained.A, chained.D, chained.dt_bias);
  const Eigen::Vector3d sc_whole(whole.A, whole.D, whole.dt_bias);
  MIXATTN_FUZZ_CHECK(close(chained.x, whole.x) && close(chained.B, whole.B) &&
                         close(chained.C, whole.C) && close(chained.dt, whole.dt) &&
                         close(sc_chained, sc_whole) && close(chained.state.h, whole.state.h),
                     "chained backward differs from one call");
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
