// libFuzzer target: the _into forms with caller-owned outputs and records reused across calls.
// Decodes up to six calls, each of a mode (GMA bidirectional or causal, OVQ, tiled or naive
// softmax attention, causal with a window or not) and shapes of its own (<= 40 tokens, NaN/Inf/
// huge/tiny/zero/duplicate rows), and runs every call twice: the value form with fresh records,
// and forward_into / backward_into into one output matrix and one record (and one gradient) per
// operator kept from call to call, whatever shapes and modes came before. Both are held to the
// oracle in fuzz_common.hpp, must give the same outcome, and when they return the same bits
// (output, OVQ's next state, gradients): a reused record may change the memory a call works in,
// never its result.
#include <mixattn/gma.hpp>
#include <mixattn/ovq.hpp>
#include <mixattn/reference.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
namespace gma = mixattn::gma;
namespace ovq = mixattn::ovq;
namespace ref = mixattn::reference;
namespace fz = mixattn::fuzz;

/// Everything reused from call to call.
template <class T>
struct Reused {
  Matrix<T> out;
  gma::Saved<T> gma_saved;
  gma::Grad<T> gma_grad;
  ovq::Saved<T> ovq_saved;
  ovq::Grad<T> ovq_grad;
  ovq::State<T> ovq_next;
  ref::Saved<T> ref_saved;
  ref::Grad<T> ref_grad;
};

/// One call's inputs.
template <class T>
struct Call {
  Index n = 0, m = 0, r = 1, dv = 1;
  Matrix<T> q, k, v, dout;
  fz::Expect ex;
  fz::Flags grad_flags;
};

template <class T>
Call<T> draw_call(fz::Bytes& in, bool causal) {
  Call<T> c;
  c.n = in.range(0, 40);
  c.m = causal ? c.n : in.range(c.n > 0 ? 1 : 0, 40);
  c.r = in.range(1, 8);
  c.dv = in.range(1, 8);
  c.ex.check_finite = in.u8() % 5 != 0;
  c.q = fz::matrix<T>(in, c.n, c.r, c.ex.flags);
  c.k = fz::matrix<T>(in, c.m, c.r, c.ex.flags);
  c.v = fz::matrix<T>(in, c.m, c.dv, c.ex.flags);
  c.dout = fz::matrix<T>(in, c.n, c.dv, c.grad_flags);
  return c;
}

/// The backward's expectation: any overflow of the gradients may be reported or (checks off)
/// returned, so the comparison of the two forms is the oracle here, with finiteness where the
/// forward's inputs and grad_out are moderate.
template <class T>
fz::Expect backward_expect(const Call<T>& c, bool& finite) {
  fz::Expect bex = c.ex;
  bex.flags.merge(c.grad_flags);
  finite = bex.must_be_finite() && bex.flags.max_abs <= 1e2;
  if (!finite) bex.flags.extreme = true;
  return bex;
}

/// Runs the value form and the _into form of one operation; both must agree on the outcome.
template <class V, class I>
bool both(const fz::Expect& ex, V&& value, I&& into) {
  const fz::Outcome a = fz::run(ex, value), b = fz::run(ex, into);
  MIXATTN_FUZZ_CHECK(a == b, "value and _into forms disagree on the outcome");
  return a == fz::Outcome::returned;
}

template <class T>
void gma_call(fz::Bytes& in, Reused<T>& u, bool causal) {
  Call<T> c = draw_call<T>(in, causal);
  gma::Options opt;
  opt.causal = causal;
  opt.check_finite = c.ex.check_finite;
  static constexpr Index chunk_menu[] = {0, 1, 3, 64};
  opt.chunk = in.pick(chunk_menu);
  const Index kc = in.range(1, 6);
  gma::Mixture<T> mix;
  mix.mean = fz::matrix<T>(in, kc, c.r, c.ex.flags);
  mix.var_raw = fz::matrix<T>(in, kc, c.r, c.ex.flags);
  mix.prior_logit = fz::vector<T>(in, kc, c.ex.flags);
  const double a = c.ex.flags.max_abs;
  if (static_cast<double>(c.r) * 4 * a * a / 1e-4 > (sizeof(T) == 4 ? 1e30 : 1e290))
    c.ex.flags.extreme = true;
  Matrix<T> out;
  gma::Saved<T> saved;
  if (!both(
          c.ex, [&] { out = gma::forward<T>(mix, c.q, c.k, c.v, opt, &saved); },
          [&] { gma::forward_into<T>(u.out, mix, c.q, c.k, c.v, opt, &u.gma_saved); }))
    return;
  fz::check_result(out, c.n, c.dv, c.ex.must_be_finite(), "gma forward");
  MIXATTN_FUZZ_CHECK(fz::same_bits(out, u.out), "gma forward_into differs from forward");
  bool finite = false;
  const fz::Expect bex = backward_expect(c, finite);
  gma::Grad<T> g;
  if (!both(
          bex, [&] { g = gma::backward<T>(mix, c.q, c.k, c.v, c.dout, saved, opt); },
          [&] {
            gma::backward_into<T>(u.gma_grad, mix, c.q, c.k, c.v, c.dout, u.gma_saved, opt);
          }))
    return;
  fz::check_result(g.q, c.n, c.r, finite, "gma grad q");
  MIXATTN_FUZZ_CHECK(fz::same_bits(g.q, u.gma_grad.q) && fz::same_bits(g.k, u.gma_grad.k) &&
                         fz::same_bits(g.v, u.gma_grad.v) &&
                         fz::same_bits(g.mixture.mean, u.gma_grad.mixture.mean) &&
                         fz::same_bits(g.mixture.var_raw, u.gma_grad.mixture.var_raw) &&
                         fz::same_bits(g.mixture.prior_logit, u.gma_grad.mixture.prior_logit),
                     "gma backward_into differs from backward");
}

template <class T>
bool same_state(const ovq::State<T>& a, const ovq::State<T>& b) {
  return fz::same_bits(a.keys, b.keys) && fz::same_bits(a.values, b.values) &&
         fz::same_bits(a.counts, b.counts) && fz::same_bits(a.pending_keys, b.pending_keys) &&
         fz::same_bits(a.pending_values, b.pending_values) && a.tokens_seen == b.tokens_seen;
}

template <class T>
void ovq_call(fz::Bytes& in, Reused<T>& u) {
  Call<T> c = draw_call<T>(in, true);
  ovq::Options opt;
  opt.check_finite = c.ex.check_finite;
  static constexpr Index block_menu[] = {1, 2, 3, 8, 64};
  opt.block = in.pick(block_menu);
  static constexpr Index cap_menu[] = {1, 3, 16, 64};
  opt.max_centroids = in.pick(cap_menu);
  opt.grad_through_dictionary = in.flag();
  // Logits reach beta sqrt(r) (unit keys): the gradients stay moderate for beta <= 2.
  const T beta = in.flag() ? T(1) : T(2);
  ovq::State<T> state = ovq::State<T>::empty(c.r, c.dv);
  const ovq::State<T> start = state;
  Matrix<T> out;
  ovq::Saved<T> saved;
  if (!both(
          c.ex, [&] { out = ovq::forward<T>(c.q, c.k, c.v, beta, opt, state, &saved); },
          [&] {
            ovq::forward_into<T>(u.out, c.q, c.k, c.v, beta, opt, start, u.ovq_next, &u.ovq_saved);
          }))
    return;
  fz::check_result(out, c.n, c.dv, c.ex.must_be_finite(), "ovq forward");
  MIXATTN_FUZZ_CHECK(fz::same_bits(out, u.out) && same_state(state, u.ovq_next),
                     "ovq forward_into differs from forward");
  bool finite = false;
  fz::Expect bex = backward_expect(c, finite);
  bex.unchecked_nan_may_reject = true;  // as in fuzz_ovq: a NaN beta cannot match itself
  ovq::Grad<T> g;
  if (!both(
          bex, [&] { g = ovq::backward<T>(c.q, c.k, c.v, beta, c.dout, saved, opt); },
          [&] {
            ovq::backward_into<T>(u.ovq_grad, c.q, c.k, c.v, beta, c.dout, u.ovq_saved, opt);
          }))
    return;
  fz::check_result(g.q, c.n, c.r, finite, "ovq grad q");
  MIXATTN_FUZZ_CHECK(fz::same_bits(g.q, u.ovq_grad.q) && fz::same_bits(g.k, u.ovq_grad.k) &&
                         fz::same_bits(g.v, u.ovq_grad.v) &&
                         std::memcmp(&g.beta, &u.ovq_grad.beta, sizeof(T)) == 0,
                     "ovq backward_into differs from backward");
}

template <class T>
void softmax_call(fz::Bytes& in, Reused<T>& u, bool flash, bool causal) {
  Call<T> c = draw_call<T>(in, causal);
  ref::Options opt;
  opt.causal = causal;
  opt.check_finite = c.ex.check_finite;
  const std::uint8_t w = in.u8();
  if (causal && w % 2 == 0) opt.window = 1 + w % (c.n + 2);
  // Logits scale |q| |k| r / sqrt(r): beyond T's range they may be reported as domain_error.
  if (c.ex.flags.max_abs * c.ex.flags.max_abs * 8 > (sizeof(T) == 4 ? 1e36 : 1e300))
    c.ex.flags.extreme = true;
  Matrix<T> out;
  ref::Saved<T> saved;
  const auto value = [&] {
    out = flash ? ref::flash_forward<T>(c.q, c.k, c.v, opt, &saved)
                : ref::naive_forward<T>(c.q, c.k, c.v, opt, &saved);
  };
  const auto into = [&] {
    if (flash)
      ref::flash_forward_into<T>(u.out, c.q, c.k, c.v, opt, &u.ref_saved);
    else
      ref::naive_forward_into<T>(u.out, c.q, c.k, c.v, opt, &u.ref_saved);
  };
  if (!both(c.ex, value, into)) return;
  fz::check_result(out, c.n, c.dv, c.ex.must_be_finite(), "softmax forward");
  MIXATTN_FUZZ_CHECK(fz::same_bits(out, u.out), "softmax forward_into differs from forward");
  bool finite = false;
  const fz::Expect bex = backward_expect(c, finite);
  ref::Grad<T> g;
  const auto bvalue = [&] {
    g = flash ? ref::flash_backward<T>(c.q, c.k, c.v, c.dout, saved, opt)
              : ref::naive_backward<T>(c.q, c.k, c.v, c.dout, saved, opt);
  };
  const auto binto = [&] {
    if (flash)
      ref::flash_backward_into<T>(u.ref_grad, c.q, c.k, c.v, c.dout, u.ref_saved, opt);
    else
      ref::naive_backward_into<T>(u.ref_grad, c.q, c.k, c.v, c.dout, u.ref_saved, opt);
  };
  if (!both(bex, bvalue, binto)) return;
  fz::check_result(g.q, c.n, c.r, finite, "softmax grad q");
  MIXATTN_FUZZ_CHECK(fz::same_bits(g.q, u.ref_grad.q) && fz::same_bits(g.k, u.ref_grad.k) &&
                         fz::same_bits(g.v, u.ref_grad.v),
                     "softmax backward_into differs from backward");
}

template <class T>
void run_case(fz::Bytes& in) {
  Reused<T> u;
  const int calls = 1 + static_cast<int>(in.u8() % 6);
  for (int i = 0; i < calls && !in.exhausted(); ++i) {
    const std::uint8_t mode = in.u8();
    if (fz::verbose()) std::cerr << "call " << i << ": mode " << int(mode % 8) << "\n";
    switch (mode % 8) {
      case 0: gma_call<T>(in, u, false); break;
      case 1: gma_call<T>(in, u, true); break;
      case 2: ovq_call<T>(in, u); break;
      case 3: softmax_call<T>(in, u, true, false); break;
      case 4: softmax_call<T>(in, u, true, true); break;
      case 5: softmax_call<T>(in, u, false, false); break;
      case 6: softmax_call<T>(in, u, false, true); break;
      default: gma_call<T>(in, u, (mode & 8) != 0); break;
    }
  }
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
