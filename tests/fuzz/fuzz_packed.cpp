// libFuzzer target: packed variable-length batches (packed.hpp) — GMA, tiled softmax attention
// and OVQ, with grouped-query heads — under offsets (cu_seqlens) chosen by an adversary. Decodes
// the operator, heads (H <= 4, H_kv dividing H), up to 5 sequences of 0 ... 12 rows each (cross-
// attention draws the keys' own lengths), one or two threads, the inputs (NaN/Inf/huge/tiny/zero/
// duplicate rows) and a corruption of the offsets: a decrease, an interior entry past the end, a
// last entry past the end or at the end of Index, a first entry other than 0, too few entries,
// q and k offsets of different counts, or (valid) repeated entries for empty sequences.
//   - invalid offsets: std::invalid_argument whose message names the offsets argument (q_offsets,
//     k_offsets, or OVQ's offsets), from forward and backward alike, with OVQ's states untouched;
//   - valid offsets: the outcome of the separate per-(sequence, head) calls (any item that
//     throws makes the packed call throw an exception of one of the items' types), and when they
//     return the same bits: outputs, OVQ's states, and GMA's gradients (dq, dk, dv in place, a
//     head's mixture gradient summed over the sequences in order; there a NaN matches any NaN,
//     see gma_backward_case). Batches of empty sequences only included.
#include <mixattn/packed.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Offsets;
using mixattn::Vector;
namespace gma = mixattn::gma;
namespace ovq = mixattn::ovq;
namespace ref = mixattn::reference;
namespace fz = mixattn::fuzz;

enum class Op { gma, flash, ovq };

// An item's block of a packed matrix, an empty block taken at (0, 0): an empty matrix's data
// pointer is null, and a block at an offset adds the offset to it.
using mixattn::detail::item_block;

/// A decoded packed call.
template <class T>
struct Case {
  Op op = Op::gma;
  Index heads = 1, kv_heads = 1, r = 1, dv = 1;
  bool causal = false, cross = false;
  int threads = 1;
  Offsets q_off, k_off;     // valid
  Offsets bad_q, bad_k;     // possibly corrupted
  bool corrupted = false;   // bad_q / bad_k are invalid
  const char* name = "";    // the argument the refusal must name
  Matrix<T> q, k, v, dout;
  bool check_finite = true;
};

Offsets draw_offsets(fz::Bytes& in, Index batch, Index max_len) {
  Offsets o{0};
  for (Index b = 0; b < batch; ++b) o.push_back(o.back() + in.range(0, max_len));
  return o;
}

/// Corrupts `o` (mode % 10): 1 a decrease, 2 an interior entry past the end, 3 a last entry past
/// the end, 4 a first entry other than 0, 5 one entry only, 6 no entry, 7 the end of Index; else
/// unchanged (9: the caller gives k one entry more). Returns whether the result is invalid.
bool corrupt(Offsets& o, std::uint8_t mode, std::uint8_t arg) {
  const std::size_t n = o.size();
  switch (mode % 10) {
    case 1:
      if (n < 3) return false;
      o[1 + arg % (n - 2)] = o.back() + 1 + arg % 3;  // larger than the entries after it
      return true;
    case 2:
      if (n < 3) return false;
      o[n - 2] = o.back() + 1;
      return true;
    case 3: o.back() += 1 + arg % 4; return true;
    case 4: o.front() = arg % 2 == 0 ? -1 : 1 + arg % 3; return true;
    case 5: o.assign(1, 0); return true;
    case 6: o.clear(); return true;
    case 7: o.back() = std::numeric_limits<Index>::max(); return true;
    default: return false;
  }
}

template <class T>
Case<T> decode(fz::Bytes& in) {
  Case<T> c;
  const std::uint8_t op = in.u8();
  c.op = op % 3 == 0 ? Op::gma : op % 3 == 1 ? Op::flash : Op::ovq;
  c.heads = in.range(1, 4);
  c.kv_heads = c.op == Op::gma ? c.heads : (in.flag() ? c.heads : 1);
  if (c.heads % c.kv_heads != 0) c.kv_heads = 1;
  c.r = in.range(1, 6);
  c.dv = in.range(1, 6);
  c.causal = c.op == Op::ovq || in.flag();
  c.cross = !c.causal && c.op != Op::ovq && in.flag();
  c.threads = in.u8() % 3 == 2 ? 2 : 1;
  c.check_finite = in.u8() % 5 != 0;
  const Index batch = in.range(1, 5);
  c.q_off = draw_offsets(in, batch, 12);
  c.k_off = c.cross ? draw_offsets(in, batch, 12) : c.q_off;
  if (in.u8() % 4 == 0) {  // empty sequences: repeat an entry of both
    const std::size_t at = in.u8() % c.q_off.size();
    c.q_off.insert(c.q_off.begin() + static_cast<std::ptrdiff_t>(at), c.q_off[at]);
    c.k_off.insert(c.k_off.begin() + static_cast<std::ptrdiff_t>(at), c.k_off[at]);
  }
  fz::Flags flags, gflags;
  c.q = fz::matrix<T>(in, c.q_off.back(), c.heads * c.r, flags);
  c.k = fz::matrix<T>(in, c.k_off.back(), c.kv_heads * c.r, flags);
  c.v = fz::matrix<T>(in, c.k_off.back(), c.kv_heads * c.dv, flags);
  c.dout = fz::matrix<T>(in, c.q_off.back(), c.heads * c.dv, gflags);
  const std::uint8_t mode = in.u8(), arg = in.u8();
  c.bad_q = c.q_off;
  c.bad_k = c.k_off;
  const bool on_k = c.cross && (arg & 128) != 0;
  c.corrupted = corrupt(on_k ? c.bad_k : c.bad_q, mode, arg);
  c.name = c.op == Op::ovq ? "offsets" : on_k ? "k_offsets" : "q_offsets";
  if (mode % 10 == 9 && c.cross) {  // q and k offsets of different counts
    c.bad_k.push_back(c.bad_k.back());
    c.corrupted = true;
    c.name = "k_offsets";
  }
  if (fz::verbose())
    std::cerr << "op=" << int(op % 3) << " H=" << c.heads << " Hkv=" << c.kv_heads << " r=" << c.r
              << " dv=" << c.dv << " causal=" << c.causal << " cross=" << c.cross
              << " threads=" << c.threads << " B=" << c.q_off.size() - 1
              << " corrupt=" << int(mode % 10) << " corrupted=" << c.corrupted << "\n";
  return c;
}

/// Runs `call` and returns how it ended: 0 returned, 1 invalid_argument, 2 domain_error; any
/// other exception fails.
template <class F>
int outcome(F&& call) {
  try {
    call();
    return 0;
  } catch (const std::invalid_argument&) {
    return 1;
  } catch (const std::domain_error&) {
    return 2;
  } catch (const std::exception& e) {
    fz::fail("undocumented exception type:", e.what());
  }
}

/// The separate calls' outcomes (bit i: some item ended with outcome i) against the packed
/// call's: returned only if every item returned, else one of the items' exception types.
inline void check_outcome(unsigned items, int packed) {
  if (items == 1u)
    MIXATTN_FUZZ_CHECK(packed == 0, "packed call threw where every separate call returned");
  else
    MIXATTN_FUZZ_CHECK(packed != 0 && (items >> packed & 1u) != 0,
                       "packed call disagrees with the separate calls' outcome");
}

template <class T>
std::vector<gma::Mixture<T>> draw_mixtures(fz::Bytes& in, const Case<T>& c) {
  std::vector<gma::Mixture<T>> mixes(static_cast<std::size_t>(c.heads));
  fz::Flags f;
  const Index kc = in.range(1, 4);
  for (gma::Mixture<T>& m : mixes) {
    m.mean = fz::matrix<T>(in, kc, c.r, f);
    m.var_raw = Matrix<T>::Zero(kc, c.r);
    m.prior_logit = Vector<T>::Zero(kc);
  }
  return mixes;
}

template <class T>
void gma_refusals(const Case<T>& c, const std::vector<gma::Mixture<T>>& mixes,
                  const gma::Options& opt) {
  Matrix<T> out;
  gma::PackedSaved<T> saved;
  fz::expect_invalid_naming(c.name, [&] {
    gma::forward_packed_into<T>(out, mixes, c.q, c.k, c.v, c.bad_q, c.bad_k, opt, &saved,
                                c.threads);
  }, "gma forward: refusal of bad offsets does not name them");
  gma::PackedGrad<T> grad;
  fz::expect_invalid_naming(c.name, [&] {
    gma::backward_packed_into<T>(grad, mixes, c.q, c.k, c.v, c.dout, c.bad_q, c.bad_k, saved, opt,
                                 c.threads);
  }, "gma backward: refusal of bad offsets does not name them");
}

/// GMA's packed backward against the separate backwards (the records of the separate forwards).
template <class T>
void gma_backward_case(const Case<T>& c, const std::vector<gma::Mixture<T>>& mixes,
                       const gma::Options& opt, const std::vector<gma::Saved<T>>& saved,
                       const gma::PackedSaved<T>& ps) {
  const Index batch = static_cast<Index>(c.q_off.size()) - 1, r = c.r, dv = c.dv;
  Matrix<T> dq(c.q.rows(), c.heads * r), dk(c.k.rows(), c.heads * r), dv_(c.k.rows(), c.heads * dv);
  std::vector<gma::MixtureGrad<T>> dmix(static_cast<std::size_t>(c.heads));
  unsigned items = 0;
  for (Index h = 0; h < c.heads; ++h)
    for (Index b = 0; b < batch; ++b) {
      const Index q0 = c.q_off[b], nq = c.q_off[b + 1] - q0, k0 = c.k_off[b],
                  nk = c.k_off[b + 1] - k0;
      items |= 1u << outcome([&] {
                 const gma::Grad<T> g = gma::backward<T>(
                     mixes[static_cast<std::size_t>(h)], item_block(c.q, q0, h * r, nq, r),
                     item_block(c.k, k0, h * r, nk, r), item_block(c.v, k0, h * dv, nk, dv),
                     item_block(c.dout, q0, h * dv, nq, dv),
                     saved[static_cast<std::size_t>(b * c.heads + h)], opt);
                 item_block(dq, q0, h * r, nq, r) = g.q;
                 item_block(dk, k0, h * r, nk, r) = g.k;
                 item_block(dv_, k0, h * dv, nk, dv) = g.v;
                 // The first sequence whose backward returns starts the sum: an earlier one may
                 // have thrown (its outcome is recorded above), leaving nothing to add to.
                 gma::MixtureGrad<T>& m = dmix[static_cast<std::size_t>(h)];
                 const bool first = m.mean.size() == 0;
                 m.mean = first ? g.mixture.mean : Matrix<T>(m.mean + g.mixture.mean);
                 m.var_raw = first ? g.mixture.var_raw : Matrix<T>(m.var_raw + g.mixture.var_raw);
                 m.prior_logit = first ? g.mixture.prior_logit
                                       : Vector<T>(m.prior_logit + g.mixture.prior_logit);
               });
    }
  gma::PackedGrad<T> grad;
  check_outcome(items, outcome([&] {
                  gma::backward_packed_into<T>(grad, mixes, c.q, c.k, c.v, c.dout, c.q_off,
                                               c.k_off, ps, opt, c.threads);
                }));
  if (items != 1u) return;
  bool same = fz::same_bits(grad.q, dq) && fz::same_bits(grad.k, dk) && fz::same_bits(grad.v, dv_);
  // The sums over sequences are this oracle's additions against the library's, the same terms in
  // the same order but other code: where two terms are NaN (checks off), which one's sign and
  // payload the sum keeps is the compiler's choice (IEEE 754 leaves it open, and compilers treat
  // + as commutative), so a NaN matches any NaN there; every other entry, bit for bit.
  for (Index h = 0; h < c.heads; ++h) {
    const gma::MixtureGrad<T>& a = grad.mixtures[static_cast<std::size_t>(h)];
    const gma::MixtureGrad<T>& e = dmix[static_cast<std::size_t>(h)];
    same = same && fz::same_values(a.mean, e.mean) && fz::same_values(a.var_raw, e.var_raw) &&
           fz::same_values(a.prior_logit, e.prior_logit);
  }
  MIXATTN_FUZZ_CHECK(same, "packed gma backward differs from separate calls");
}

/// GMA: packed forward and backward against the separate calls, bit for bit.
template <class T>
void gma_case(fz::Bytes& in, const Case<T>& c) {
  const std::vector<gma::Mixture<T>> mixes = draw_mixtures(in, c);
  gma::Options opt;
  opt.causal = c.causal;
  opt.check_finite = c.check_finite;
  if (c.corrupted) return gma_refusals(c, mixes, opt);
  const Index batch = static_cast<Index>(c.q_off.size()) - 1, r = c.r, dv = c.dv;
  Matrix<T> want = Matrix<T>::Zero(c.q.rows(), c.heads * dv);
  std::vector<gma::Saved<T>> saved(static_cast<std::size_t>(batch * c.heads));
  unsigned items = 0;
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < c.heads; ++h) {
      const Index q0 = c.q_off[b], nq = c.q_off[b + 1] - q0, k0 = c.k_off[b],
                  nk = c.k_off[b + 1] - k0;
      items |= 1u << outcome([&] {
                 item_block(want, q0, h * dv, nq, dv) = gma::forward<T>(
                     mixes[static_cast<std::size_t>(h)], item_block(c.q, q0, h * r, nq, r),
                     item_block(c.k, k0, h * r, nk, r), item_block(c.v, k0, h * dv, nk, dv), opt,
                     &saved[static_cast<std::size_t>(b * c.heads + h)]);
               });
    }
  Matrix<T> out;
  gma::PackedSaved<T> ps;
  check_outcome(items, outcome([&] {
                  gma::forward_packed_into<T>(out, mixes, c.q, c.k, c.v, c.q_off, c.k_off, opt,
                                              &ps, c.threads);
                }));
  if (items != 1u) return;
  MIXATTN_FUZZ_CHECK(fz::same_bits(out, want), "packed gma forward differs from separate calls");
  gma_backward_case(c, mixes, opt, saved, ps);
}

/// Tiled softmax attention with grouped-query heads: packed forward against separate calls.
template <class T>
void flash_case(const Case<T>& c) {
  ref::Options opt;
  opt.causal = c.causal;
  opt.check_finite = c.check_finite;
  Matrix<T> out;
  ref::PackedSaved<T> ps;
  const auto packed = [&](const Offsets& qo, const Offsets& ko) {
    ref::flash_forward_packed_into<T>(out, c.heads, c.kv_heads, c.q, c.k, c.v, qo, ko, opt, &ps,
                                      c.threads);
  };
  if (c.corrupted) {
    fz::expect_invalid_naming(c.name, [&] { packed(c.bad_q, c.bad_k); },
                              "flash forward: refusal of bad offsets does not name them");
    ref::PackedGrad<T> grad;
    fz::expect_invalid_naming(c.name, [&] {
      ref::flash_backward_packed_into<T>(grad, c.heads, c.kv_heads, c.q, c.k, c.v, c.dout,
                                         c.bad_q, c.bad_k, ps, opt, c.threads);
    }, "flash backward: refusal of bad offsets does not name them");
    return;
  }
  const Index batch = static_cast<Index>(c.q_off.size()) - 1, r = c.r, dv = c.dv;
  const Index group = c.heads / c.kv_heads;
  Matrix<T> want = Matrix<T>::Zero(c.q.rows(), c.heads * dv);
  unsigned items = 0;
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < c.heads; ++h) {
      const Index q0 = c.q_off[b], nq = c.q_off[b + 1] - q0, k0 = c.k_off[b],
                  nk = c.k_off[b + 1] - k0, g = h / group;
      items |= 1u << outcome([&] {
                 item_block(want, q0, h * dv, nq, dv) = ref::flash_forward<T>(
                     item_block(c.q, q0, h * r, nq, r), item_block(c.k, k0, g * r, nk, r),
                     item_block(c.v, k0, g * dv, nk, dv), opt);
               });
    }
  check_outcome(items, outcome([&] { packed(c.q_off, c.k_off); }));
  if (items == 1u)
    MIXATTN_FUZZ_CHECK(fz::same_bits(out, want), "packed flash forward differs from separate calls");
}

template <class T>
bool same_state(const ovq::State<T>& a, const ovq::State<T>& b) {
  return fz::same_bits(a.keys, b.keys) && fz::same_bits(a.values, b.values) &&
         fz::same_bits(a.counts, b.counts) && fz::same_bits(a.pending_keys, b.pending_keys) &&
         fz::same_bits(a.pending_values, b.pending_values) && a.tokens_seen == b.tokens_seen;
}

/// OVQ (causal, one offsets vector): packed forward against separate calls, states included;
/// a refused call leaves every state as it was.
template <class T>
void ovq_case(fz::Bytes& in, const Case<T>& c) {
  ovq::Options opt;
  opt.check_finite = c.check_finite;
  static constexpr Index block_menu[] = {1, 2, 3, 8};
  opt.block = in.pick(block_menu);
  opt.max_centroids = in.range(1, 8);
  std::vector<T> beta(static_cast<std::size_t>(c.heads), T(1));
  const Index batch = static_cast<Index>(c.q_off.size()) - 1, r = c.r, dv = c.dv;
  std::vector<ovq::State<T>> states(static_cast<std::size_t>(std::max<Index>(batch, 1) * c.heads),
                                    ovq::State<T>::empty(r, dv));
  Matrix<T> out;
  ovq::PackedSaved<T> ps;
  if (c.corrupted) {
    const std::vector<ovq::State<T>> before = states;
    fz::expect_invalid_naming(c.name, [&] {
      ovq::forward_packed_into<T>(out, c.kv_heads, c.q, c.k, c.v, beta, c.bad_q, opt, states, &ps,
                                  c.threads);
    }, "ovq forward: refusal of bad offsets does not name them");
    for (std::size_t i = 0; i < states.size(); ++i)
      MIXATTN_FUZZ_CHECK(same_state(states[i], before[i]), "a refused packed call moved a state");
    return;
  }
  const Index group = c.heads / c.kv_heads;
  std::vector<ovq::State<T>> sep = states;
  Matrix<T> want = Matrix<T>::Zero(c.q.rows(), c.heads * dv);
  unsigned items = 0;
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < c.heads; ++h) {
      const Index q0 = c.q_off[b], nq = c.q_off[b + 1] - q0, g = h / group;
      items |= 1u << outcome([&] {
                 item_block(want, q0, h * dv, nq, dv) = ovq::forward<T>(
                     item_block(c.q, q0, h * r, nq, r), item_block(c.k, q0, g * r, nq, r),
                     item_block(c.v, q0, g * dv, nq, dv), beta[static_cast<std::size_t>(h)], opt,
                     sep[static_cast<std::size_t>(b * c.heads + h)]);
               });
    }
  check_outcome(items, outcome([&] {
                  ovq::forward_packed_into<T>(out, c.kv_heads, c.q, c.k, c.v, beta, c.q_off, opt,
                                              states, &ps, c.threads);
                }));
  if (items != 1u) return;
  MIXATTN_FUZZ_CHECK(fz::same_bits(out, want), "packed ovq forward differs from separate calls");
  for (std::size_t i = 0; i < states.size(); ++i)
    MIXATTN_FUZZ_CHECK(same_state(states[i], sep[i]), "packed ovq state differs from separate call");
}

template <class T>
void run_case(fz::Bytes& in) {
  const Case<T> c = decode<T>(in);
  switch (c.op) {
    case Op::gma: gma_case(in, c); break;
    case Op::flash: flash_case(c); break;
    case Op::ovq: ovq_case(in, c); break;
  }
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
