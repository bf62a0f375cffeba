// libFuzzer target: the gated delta rule (delta.hpp, SPEC §9) and its state continued over pieces
// (9.2) and through the backward (9.3). Decodes d_k, d_v <= 8, a sequence of <= 48 tokens
// (NaN/Inf/huge/tiny/zero/duplicate rows), the gates g and beta (mapped into their domains, or
// raw), options (chunk, scale, normalize, norm_eps, keep_states, check_finite), an optional start
// state, a cut into up to 5 pieces (empty ones included), the form (value or _into) and a
// mismatch to inject. Every call is held to the oracle in fuzz_common.hpp, and:
//   - g > 0 or beta outside [0, 1] throw std::domain_error whatever check_finite says;
//   - a forward that throws leaves the State bitwise unchanged;
//   - for moderate inputs (q and k normalised inside, |x| <= 1e4) the pieces' outputs and end
//     state equal one call's, and so does decoding token by token;
//   - the pieces' backwards run in reverse, each fed its successor's grad.state, give finite
//     gradients, and in double equal one call's backward;
//   - a state of another shape, chunk 0, g of another length, a record given other data, a
//     grad_state_out of another state, or one given to a record of a forward without a State
//     are refused with std::invalid_argument naming the argument.
#include <mixattn/delta.hpp>

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
namespace delta = mixattn::delta;
namespace fz = mixattn::fuzz;

using fz::max_abs;

template <class T>
using Wide = mixattn::detail::wide_t<T>;

/// One decoded case: the sequence, its gates, the start state, the cut and what to inject.
template <class T>
struct Case {
  delta::Options opt;
  Matrix<T> q, k, v, dout;
  Vector<T> g, beta;
  Matrix<Wide<T>> S0;  // d_k x d_v (zero without a start state)
  std::vector<Index> cuts;
  fz::Expect ex;  // of the whole sequence
  fz::Flags grad_flags;
  bool out_of_domain = false;  // some g > 0 or beta outside [0, 1]
  bool into = false;
  std::uint8_t mismatch = 0;
  Index n() const { return q.rows(); }
  Index dk() const { return q.cols(); }
  Index dv() const { return v.cols(); }
};

/// The flags of rows [0, end) of q, k, v, g and beta, and of the start state: what a piece
/// ending at `end` has read, through the state it continues.
template <class T>
fz::Flags prefix_flags(const Case<T>& c, Index end) {
  fz::Flags f;
  const auto add = [&f](const auto& m) {
    for (Index i = 0; i < m.rows(); ++i)
      for (Index j = 0; j < m.cols(); ++j) fz::classify<T>(static_cast<double>(m(i, j)), f);
  };
  add(c.q.topRows(end));
  add(c.k.topRows(end));
  add(c.v.topRows(end));
  add(c.g.head(end));
  add(c.beta.head(end));
  add(c.S0.template cast<T>());
  if (!c.opt.normalize) f.extreme = true;  // the caller's key norms: the state may grow
  return f;
}

template <class T>
Case<T> decode(fz::Bytes& in) {
  Case<T> c;
  const Index dk = in.range(1, 8), dv = in.range(1, 8), n = in.range(0, 48);
  static constexpr Index chunk_menu[] = {64, 1, 2, 3, 5, 16};
  c.opt.chunk = in.pick(chunk_menu);
  static constexpr double scale_menu[] = {0, 0, 0.5, 3};
  c.opt.scale = in.pick(scale_menu);
  c.opt.normalize = in.u8() % 4 != 0;
  static constexpr double eps_menu[] = {1e-6, 1e-6, 1e-3, 1};
  c.opt.norm_eps = in.pick(eps_menu);
  c.opt.keep_states = in.flag();
  c.opt.check_finite = in.u8() % 5 != 0;
  const bool with_state = in.flag();
  const bool raw_gates = in.u8() % 8 == 0;
  c.into = in.flag();
  c.mismatch = in.u8();
  c.ex.check_finite = c.opt.check_finite;
  fz::Flags ignored;  // every input is classified as the operator sees it (prefix_flags)
  c.q = fz::matrix<T>(in, n, dk, ignored);
  c.k = fz::matrix<T>(in, n, dk, ignored);
  c.v = fz::matrix<T>(in, n, dv, ignored);
  c.g = fz::vector<T>(in, n, ignored);
  c.beta = fz::vector<T>(in, n, ignored);
  if (!raw_gates) {  // into the domain: g = -|x|, beta = sigmoid(x) (NaN stays NaN)
    c.g = -c.g.cwiseAbs();
    for (Index t = 0; t < n; ++t)
      c.beta(t) = static_cast<T>(1 / (1 + std::exp(-static_cast<double>(c.beta(t)))));
  }
  for (Index t = 0; t < n; ++t)
    c.out_of_domain |= c.g(t) > T(0) || c.beta(t) < T(0) || c.beta(t) > T(1);
  c.S0 = Matrix<Wide<T>>::Zero(dk, dv);
  if (with_state) c.S0 = fz::matrix<T>(in, dk, dv, ignored).template cast<Wide<T>>();
  c.dout = fz::matrix<T>(in, n, dv, c.grad_flags);
  c.cuts = fz::pieces(in, n, 5);
  c.ex.flags = prefix_flags(c, n);
  return c;
}

template <class T>
delta::State<T> start_state(const Case<T>& c) {
  delta::State<T> st = delta::State<T>::empty(c.dk(), c.dv());
  st.S = c.S0;
  return st;
}

/// The injected refusals of a forward: a state of another shape, chunk 0, g of another length.
template <class T>
void forward_mismatch(const Case<T>& c) {
  delta::State<T> st = start_state(c);
  delta::Options opt = c.opt;
  const Vector<T> longer_g = Vector<T>::Zero(c.n() + 1);
  switch (c.mismatch % 8) {
    case 1:  // the state is checked after the inputs, whose values may throw first
      if (c.out_of_domain || (c.opt.check_finite && c.ex.flags.non_finite)) break;
      st = delta::State<T>::empty(c.dk() + 1, c.dv());
      fz::expect_invalid_naming(
          "state", [&] { delta::forward<T>(c.q, c.k, c.v, c.g, c.beta, opt, &st); },
          "a state of another shape");
      break;
    case 2:
      opt.chunk = 0;
      fz::expect_invalid_naming(
          "chunk", [&] { delta::forward<T>(c.q, c.k, c.v, c.g, c.beta, opt, &st); }, "chunk 0");
      break;
    case 3:
      fz::expect_invalid_naming(
          "g has", [&] { delta::forward<T>(c.q, c.k, c.v, longer_g, c.beta, opt, &st); },
          "g of another length");
      break;
    default:
      break;
  }
}

/// The forward over the pieces, each with its own record, the state carried; false when a piece
/// threw (the state then unchanged).
template <class T>
bool forward_pieces(const Case<T>& c, Matrix<T>& out, std::vector<delta::Saved<T>>& saved,
                    delta::State<T>& st) {
  out.resize(c.n(), c.dv());
  saved.resize(c.cuts.size());
  st = start_state(c);
  Index row0 = 0;
  for (std::size_t p = 0; p < c.cuts.size(); ++p) {
    const Index len = c.cuts[p];
    fz::Expect pex = c.ex;
    pex.flags = prefix_flags(c, row0 + len);
    const delta::State<T> before = st;
    Matrix<T> o;
    const fz::Outcome r = fz::run(pex, [&] {
      const auto q = c.q.middleRows(row0, len), k = c.k.middleRows(row0, len);
      const auto v = c.v.middleRows(row0, len);
      const auto g = c.g.segment(row0, len), b = c.beta.segment(row0, len);
      if (c.into)
        delta::forward_into<T>(o, q, k, v, g, b, c.opt, &st, &saved[p]);
      else
        o = delta::forward<T>(q, k, v, g, b, c.opt, &st, &saved[p]);
    });
    if (r != fz::Outcome::returned) {
      MIXATTN_FUZZ_CHECK(fz::same_bits(st.S, before.S) && st.tokens_seen == before.tokens_seen,
                         "a forward that threw changed the state");
      return false;
    }
    fz::check_result(o, len, c.dv(), pex.must_be_finite(), "piece output");
    out.middleRows(row0, len) = o;
    row0 += len;
  }
  return true;
}

/// The pieces' backwards in reverse, each given its successor's grad.state: the gradients of
/// the whole sequence in `total`; false when one threw.
template <class T>
bool backward_pieces(const Case<T>& c, const std::vector<delta::Saved<T>>& saved,
                     delta::Grad<T>& total, const fz::Expect& bex) {
  total.q.resize(c.n(), c.dk());
  total.k.resize(c.n(), c.dk());
  total.v.resize(c.n(), c.dv());
  total.g.resize(c.n());
  total.beta.resize(c.n());
  delta::Grad<T> g;
  Index row0 = c.n();
  bool carried = false;  // a non-finite grad_out of a later piece, carried by grad.state
  for (std::size_t p = c.cuts.size(); p-- > 0;) {
    const Index len = c.cuts[p];
    row0 -= len;
    const bool last = p + 1 == c.cuts.size();
    const delta::StateGrad<T> next = g.state;
    fz::Expect pex = bex;  // q, k, v, g, beta are finite here; grad_out by piece
    fz::Flags rows;
    const auto d_rows = c.dout.middleRows(row0, len);
    for (Index i = 0; i < d_rows.rows(); ++i)
      for (Index j = 0; j < d_rows.cols(); ++j)
        fz::classify<T>(static_cast<double>(d_rows(i, j)), rows);
    pex.flags.non_finite = rows.non_finite || carried;
    carried = pex.flags.non_finite;
    const fz::Outcome r = fz::run(pex, [&] {
      const auto q = c.q.middleRows(row0, len), k = c.k.middleRows(row0, len);
      const auto v = c.v.middleRows(row0, len), d = c.dout.middleRows(row0, len);
      const auto gg = c.g.segment(row0, len), b = c.beta.segment(row0, len);
      if (c.into)
        delta::backward_into<T>(g, q, k, v, gg, b, d, saved[p], c.opt, last ? nullptr : &g.state);
      else
        g = delta::backward<T>(q, k, v, gg, b, d, saved[p], c.opt, last ? nullptr : &next);
    });
    if (r != fz::Outcome::returned) return false;
    total.q.middleRows(row0, len) = g.q;
    total.k.middleRows(row0, len) = g.k;
    total.v.middleRows(row0, len) = g.v;
    total.g.segment(row0, len) = g.g;
    total.beta.segment(row0, len) = g.beta;
    MIXATTN_FUZZ_CHECK(g.state.S.rows() == c.dk() && g.state.S.cols() == c.dv(),
                       "grad.state of the wrong shape");
  }
  total.state = g.state;
  return true;
}

/// The injected refusals of a backward (finite inputs): a record given other data, a
/// grad_state_out of another state, one given to a record of a forward without a State.
template <class T>
void backward_mismatch(const Case<T>& c, const std::vector<delta::Saved<T>>& saved) {
  std::size_t p = 0;
  Index row0 = 0;
  while (p < c.cuts.size() && c.cuts[p] == 0) ++p;
  if (p == c.cuts.size()) return;  // nothing but empty pieces
  for (std::size_t i = 0; i < p; ++i) row0 += c.cuts[i];
  const Index len = c.cuts[p];
  Matrix<T> q = c.q.middleRows(row0, len);
  const auto k = c.k.middleRows(row0, len), v = c.v.middleRows(row0, len);
  const auto d = c.dout.middleRows(row0, len);
  const auto g = c.g.segment(row0, len), b = c.beta.segment(row0, len);
  switch (c.mismatch % 8) {
    case 4:
      q(0, 0) = q(0, 0) == T(0) ? T(1) : T(0);
      fz::expect_invalid_naming(
          "q", [&] { delta::backward<T>(q, k, v, g, b, d, saved[p], c.opt); }, "other q");
      break;
    case 5: {
      delta::StateGrad<T> other;
      other.S = Matrix<Wide<T>>::Zero(c.dk(), c.dv());
      other.state_fingerprint = saved[p].end_fingerprint ^ 1;
      fz::expect_invalid_naming(
          "grad_state_out", [&] { delta::backward<T>(q, k, v, g, b, d, saved[p], c.opt, &other); },
          "a grad_state_out of another state");
      break;
    }
    case 6: {
      delta::Saved<T> plain;
      delta::forward<T>(q, k, v, g, b, c.opt, nullptr, &plain);
      delta::StateGrad<T> gs;
      gs.S = Matrix<Wide<T>>::Zero(c.dk(), c.dv());
      fz::expect_invalid_naming(
          "grad_state_out", [&] { delta::backward<T>(q, k, v, g, b, d, plain, c.opt, &gs); },
          "a grad_state_out without a State");
      break;
    }
    default:
      break;
  }
}

template <class T>
void run_case(fz::Bytes& in) {
  const bool is_float = std::is_same<T, float>::value;
  const Case<T> c = decode<T>(in);
  forward_mismatch(c);
  if (c.out_of_domain) {  // refused whatever check_finite says, the state untouched
    delta::State<T> st = start_state(c);
    fz::Expect dex = c.ex;
    dex.flags.non_finite = true;
    dex.check_finite = true;
    const fz::Outcome r =
        fz::run(dex, [&] { delta::forward<T>(c.q, c.k, c.v, c.g, c.beta, c.opt, &st); });
    MIXATTN_FUZZ_CHECK(r == fz::Outcome::domain_error, "gates out of their domain must throw");
    MIXATTN_FUZZ_CHECK(fz::same_bits(st.S, c.S0), "a refused forward changed the state");
    return;
  }
  Matrix<T> out;
  std::vector<delta::Saved<T>> saved;
  delta::State<T> st;
  if (!forward_pieces(c, out, saved, st)) return;
  if (!c.ex.must_be_finite() || c.ex.flags.extreme)
    return;  // hostile: the refusals were the oracle
  delta::State<T> one_state = start_state(c);
  delta::Saved<T> one_saved;
  const Matrix<T> one =
      delta::forward<T>(c.q, c.k, c.v, c.g, c.beta, c.opt, &one_state, &one_saved);
  // |o| <= scale |S| and |S| <= |S0| + sum |v_t| (normalised keys and beta in [0, 1] make each
  // token's map a contraction): a bound on every entry the rounding is relative to.
  const double scale = c.opt.scale > 0 ? c.opt.scale : 1.0;
  const double bound = std::max(1.0, scale) * static_cast<double>(c.dk() + c.dv()) *
                       (max_abs(c.S0) + static_cast<double>(c.n() + 1) * max_abs(c.v));
  const bool moderate = c.ex.flags.max_abs <= 1e4;
  const double tol = (is_float ? 1e-4 : 1e-10) * bound +
                     16 * static_cast<double>(c.n() + 1) *
                         static_cast<double>(std::numeric_limits<T>::denorm_min());
  if (moderate) {
    MIXATTN_FUZZ_CHECK(max_abs(out - one) <= tol, "pieces differ from one call");
    MIXATTN_FUZZ_CHECK(max_abs(st.S - one_state.S) <= tol, "end states differ");
    delta::State<T> dec = start_state(c);
    Matrix<T> row;
    for (Index t = 0; t < c.n(); ++t) {
      delta::forward_into<T>(row, c.q.row(t), c.k.row(t), c.v.row(t), c.g.segment(t, 1),
                             c.beta.segment(t, 1), c.opt, &dec, nullptr);
      MIXATTN_FUZZ_CHECK(max_abs(row - one.row(t)) <= tol, "decoding differs from the forward");
    }
  }
  fz::Expect bex = c.ex;
  bex.flags.merge(c.grad_flags);
  const bool bounded = moderate && !c.grad_flags.non_finite && c.grad_flags.max_abs <= 1e4;
  if (bounded) backward_mismatch(c, saved);
  if (!bounded) bex.flags.extreme = true;
  delta::Grad<T> chained;
  if (!backward_pieces(c, saved, chained, bex)) return;
  const bool finite = bounded || (c.opt.check_finite && !bex.flags.non_finite);
  fz::check_result(chained.q, c.n(), c.dk(), finite, "chained grad q");
  fz::check_result(chained.k, c.n(), c.dk(), finite, "chained grad k");
  fz::check_result(chained.v, c.n(), c.dv(), finite, "chained grad v");
  fz::check_result(chained.g, c.n(), 1, finite, "chained grad g");
  fz::check_result(chained.beta, c.n(), 1, finite, "chained grad beta");
  fz::check_result(chained.state.S, c.dk(), c.dv(), finite, "chained grad state");
  // Compared in double only, where the gradients are of the size of their terms (|x| <= 100,
  // norm_eps >= 1e-3: no row's normalisation amplifies by more than 30): rounding of a few
  // hundred terms, far below 1e-7 of the largest.
  if (is_float || !bounded || c.ex.flags.max_abs > 100 || c.opt.norm_eps < 1e-3) return;
  const delta::Grad<T> whole =
      delta::backward<T>(c.q, c.k, c.v, c.g, c.beta, c.dout, one_saved, c.opt);
  const auto close = [](const auto& x, const auto& y) {
    return max_abs(x - y) <= 1e-7 * (max_abs(x) + max_abs(y)) + 1e-300;
  };
  MIXATTN_FUZZ_CHECK(close(chained.q, whole.q) && close(chained.k, whole.k) &&
                         close(chained.v, whole.v) && close(chained.g, whole.g) &&
                         close(chained.beta, whole.beta) && close(chained.state.S, whole.state.S),
                     "chained backward differs from one call");
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
