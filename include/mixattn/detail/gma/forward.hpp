// mixattn/detail/gma/forward.hpp — GMA's forward (SPEC.md §1.2–1.4): the bidirectional read-out,
// the record for backward, the whole-sequence body and the continued (State) body with its
// one-token path.
//
// Internal: part of mixattn/gma.hpp; the records it works on are in mixattn/gma_types.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/causal_scan.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/gma/common.hpp"
#include "mixattn/gma_types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Bidirectional read-out (SPEC 1.3): Vt = Gamma_K^T V, z = Gamma_K^T 1, then numerators by
/// GEMM and denominators by GEMV (cheaper than copying V into [V | 1] for the ones column).
template <class T>
void gma_bidirectional_forward(const Matrix<T>& gq, const Matrix<T>& gk, const ConstMatrixRef<T>& v,
                               T eps, Matrix<T>& vt, Vector<T>& z, Matrix<T>& out, Vector<T>& den,
                               GmaForwardScratch<T>& s) {
  const Index K = gq.cols(), d_v = v.cols();
  vt.resize(K, d_v);
  gemm<T>(vt, transposed<T>(gk), plain<T>(v), T(1), false, s.gemm);
  z.resize(K);
  s.ones.setOnes(gk.rows());  // a stored vector: the GEMV reads it in place, no temporary
  z.noalias() = gk.transpose() * s.ones;
  gemm<T>(out, plain<T>(gq), plain<T>(vt), T(1), false, s.gemm);
  den.noalias() = gq * z;
  den.array() += eps;
  out.array().colwise() /= den.array();
}

/// Whether a forward writes Gamma_Q and Gamma_K whole (for a record) or one block of rows at a
/// time through the first rows of its buffers.
enum class GammaRows { whole, blocks };

#if MIXATTN_HAS_SIMD
/// Bidirectional forward (SPEC 1.3) fused with the responsibilities: each block of
/// gma_gamma_block rows of Gamma_K goes into [Vt | z] while it is still in L1, then each block of
/// Gamma_Q rows is read out at once, so neither product packs or re-reads Gamma from memory.
/// With GammaRows::whole (a record), Gamma_Q and Gamma_K are written to gq, gk whole, block by
/// block; with GammaRows::blocks, each block goes through the first rows of gq, gk, which stay in
/// L1: nothing of size N x K is written (2 MiB of stores at N = 4096, K = 64 that nothing reads
/// again). Same sums as the GEMMs, in another order. A block's responsibilities are all computed
/// before its write or read (not tile by tile), so that the density kernel's coefficients stay in
/// L1 across the block's tiles instead of being evicted by [Vt | z] after each one (N = 4096, K = r
/// = d_v = 64, AVX2: the forward ~3% faster).
template <class Arch, class T>
void gma_bidirectional_fused(const PackedDensity<T>& p, const ConstMatrixRef<T>& q,
                             const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, T eps,
                             bool check, const char* fn, GammaRows rows_kept, Matrix<T>& gq,
                             Matrix<T>& gk, Matrix<T>& vt, Vector<T>& z, Matrix<T>& out,
                             Vector<T>& den, GmaForwardScratch<T>& s) {
  const Index K = p.components, d_v = v.cols(), ldv = v.outerStride();
  const bool keep = rows_kept == GammaRows::whole;
  vt.setZero(K, d_v);
  z.setZero(K);
  // hook(g, i, n): rows [i, i + n) of Gamma, at g
  const auto pass = [&](const ConstMatrixRef<T>& x, Matrix<T>& g, const char* arg, auto&& hook) {
    const Index rows = x.rows(), block = gma_gamma_block;
    g.resize(keep ? rows : std::min(rows, block), K);
    for (Index b0 = 0; b0 < rows; b0 += block) {
      const Index n = std::min(block, rows - b0);
      T* const at = g.data() + (keep ? b0 * K : 0);
      gma_gamma_into<Arch, T>(p, x.middleRows(b0, n), at, check, fn, arg, &s.scores, b0);
      hook(at, b0, n);
    }
  };
  pass(k, gk, "k", [&](const T* g, Index i0, Index n) {
    write_block<Arch>(g, K, v.data() + i0 * ldv, ldv, n, K, d_v, vt.data(), d_v);
    add_rows(Arch{}, g, K, n, K, z.data());
  });
  pass(q, gq, "q", [&](const T* g, Index i0, Index n) {
    dot_rows(Arch{}, g, K, n, K, z.data(), eps, den.data() + i0);
    read_block<Arch>(ReadSources<T>{g, K, vt.data(), d_v, K}, n, d_v, den.data() + i0,
                     out.data() + i0 * d_v, d_v);
  });
}

/// Whether the bidirectional output out_i = (gamma_i . Vt) / den_i is finite for certain, from
/// Vt and den alone: O(K d_v + N) instead of a pass over the N x d_v output. gamma_i >= 0 sums to
/// 1 up to K roundings, so each of the read's partial sums and its result are at most
/// (1 + 2 K u) max|Vt| / den_i after their roundings (u = T's unit roundoff, K u <= 1/8 here),
/// below 2 max|Vt| / min den. False (the caller scans the output) when Vt or den is not finite,
/// den is not positive, K u > 1/8, or 2 max|Vt| / min den exceeds T's largest value. Vt is not
/// finite after any inf or NaN in v (gamma * NaN is NaN even where gamma is 0), which is how the
/// forward without a record finds one.
template <class T>
bool gma_bidirectional_output_bounded(const Matrix<T>& vt, const Vector<T>& den) {
  if (vt.size() == 0 || den.size() == 0) return true;  // an empty output
  if (static_cast<double>(vt.rows()) * std::numeric_limits<T>::epsilon() / 2 > 0.125) return false;
  if (!all_finite(vt) || !all_finite(den)) return false;
  const double min_den = static_cast<double>(den.minCoeff());
  const double max_vt = static_cast<double>(vt.cwiseAbs().maxCoeff());
  return min_den > 0 && max_vt / min_den <= static_cast<double>(std::numeric_limits<T>::max()) / 2;
}
#endif

/// This thread's forward scratch, for calls without `saved` (kept for the thread's lifetime).
template <class T>
GmaForwardScratch<T>& gma_thread_scratch() {
  thread_local GmaForwardScratch<T> scratch;
  return scratch;
}

/// Completes a Saved record whose gamma_q, gamma_k and den the forward wrote in place: the
/// output, the options and the fingerprints of the call's own inputs.
/// The start state (saved.start_S, saved.start_z: empty for a whole sequence) is in place
/// before the call; its fingerprint is taken here, and end_fingerprint is reset (a continued
/// forward sets it after). O(size) passes, no allocation.
/// input_fp: the fingerprints of q, k and v if the caller took them (gma_fingerprint_inputs),
/// else null.
template <class T>
void gma_save(gma::Saved<T>& saved, const Matrix<T>& out, const ConstMatrixRef<T>& q,
              const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, const gma::Options& opt,
              std::uint64_t mixture_fingerprint, const std::uint64_t* input_fp = nullptr) {
  // the causal backward's h needs the output; the bidirectional one forms dO . O from Vt
  if (opt.causal)
    saved.out = out;
  else
    saved.out.resize(0, 0);
  saved.causal = opt.causal;
  saved.eps = opt.eps;
  saved.chunk = gma_chunk(opt);
  saved.fingerprint.q = input_fp ? input_fp[0] : fingerprint(q);
  saved.fingerprint.k = input_fp ? input_fp[1] : fingerprint(k);
  saved.fingerprint.v = input_fp ? input_fp[2] : fingerprint(v);
  saved.fingerprint.mixture = mixture_fingerprint;
  saved.fingerprint.start_state = gma_state_fingerprint(saved.start_S, saved.start_z);
  saved.end_fingerprint = 0;
  saved.valid = true;
}

/// The end of a whole-sequence forward: the output's check and the record.
template <class T>
void gma_forward_finish(const char* fn, const Matrix<T>& out, const ConstMatrixRef<T>& q,
                        const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                        const gma::Options& opt, const gma::Mixture<T>& mix, gma::Saved<T>* saved,
                        const std::uint64_t* input_fp, bool output_bounded = false) {
  // Gamma is finite now, so only the sums of v over keys can overflow (the output itself is a
  // weighted mean of v's rows). output_bounded: the caller showed the output finite without
  // reading it (gma_bidirectional_output_bounded).
  if (opt.check_finite && !output_bounded) require_finite_result(out, fn, "the output", "v is");
  if (saved) {
    if (opt.causal) {
      saved->vt.resize(0, 0);
      saved->z.resize(0);
    }
    saved->continued = false;
    saved->start_S.resize(0, 0);
    saved->start_z.resize(0);
    gma_save(*saved, out, q, k, v, opt, mixture_fingerprint(mix), input_fp);
  }
}

/// Where one forward call writes, chosen once for the call: the record's buffers when it keeps
/// one for backward, else this thread's (its forward scratch and Gamma workspace, so a steady
/// stream of calls neither page-faults fresh memory nor returns it to the OS each time).
template <class T>
struct GmaForwardBuffers {
  GmaForwardScratch<T>& scratch;
  Matrix<T>& gamma_q;  // N x K, whole: the record's, or the thread's workspace
  Matrix<T>& gamma_k;  // M x K
  Matrix<T>& block_q;  // the fused bidirectional forward's Gamma rows: the record's whole Gamma,
  Matrix<T>& block_k;  // or one block of rows at a time
  Matrix<T>& vt;       // K x d_v, Gamma_K^T V (bidirectional)
  Vector<T>& z;        // K, Gamma_K^T 1 (bidirectional)
  Vector<T>& den;      // N
  Matrix<wide_t<T>>& start_S;  // a continued forward's start state
  Vector<wide_t<T>>& start_z;
};

template <class T>
MIXATTN_ALWAYS_INLINE GmaForwardBuffers<T> gma_forward_buffers(gma::Saved<T>* saved) {
  if (saved != nullptr)
    return {saved->scratch, saved->gamma_q, saved->gamma_k, saved->gamma_q, saved->gamma_k,
            saved->vt,      saved->z,       saved->den,     saved->start_S, saved->start_z};
  GmaForwardScratch<T>& s = gma_thread_scratch<T>();
  GmaGammaWorkspace<T>& w = gma_gamma_workspace<T>();
  return {s, w.queries, w.keys, s.block_q, s.block_k, s.vt, s.z, s.den, s.start_S, s.start_z};
}

/// The causal forward without a record, which keeps no Gamma: blocks of whole chunks, their
/// Gamma_Q and Gamma_K computed and scanned while they are in cache (the scan continues its
/// state from block to block, so the chunks and their sums are those of one pass).
template <class Arch, class T>
void gma_causal_forward_blocks(const char* fn, GmaForwardScratch<T>& s, const ConstMatrixRef<T>& q,
                               const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                               const gma::Options& opt, Matrix<T>& out, Vector<T>& den) {
  const Index N = q.rows(), K = s.packed.components, d_v = v.cols();
  const Index chunk = gma_chunk(opt);
  const Index block = (gma_causal_block + chunk - 1) / chunk * chunk;
  s.scan.S.setZero(K, d_v);
  s.scan.z.setZero(K);
  s.block_q.resize(std::min(N, block), K);
  s.block_k.resize(std::min(N, block), K);
  for (Index b0 = 0; b0 < N; b0 += block) {
    const Index n = std::min(block, N - b0);
    gma_gamma_into<Arch, T>(s.packed, q.middleRows(b0, n), s.block_q.data(), opt.check_finite, fn,
                            "q", &s.scores, b0);
    gma_gamma_into<Arch, T>(s.packed, k.middleRows(b0, n), s.block_k.data(), opt.check_finite, fn,
                            "k", &s.scores, b0);
    causal_scan_forward<T, Arch>(s.block_q.topRows(n), s.block_k.topRows(n), v.middleRows(b0, n),
                                 static_cast<T>(opt.eps), chunk, out.middleRows(b0, n),
                                 den.segment(b0, n), s.scan.S, s.scan.z, s.scan);
  }
}

/// forward_into's body; `fn` names the public entry point in messages.
template <class Arch, class T>
void gma_forward_into(const char* fn, Matrix<T>& out, const gma::Mixture<T>& mix,
                      const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                      const ConstMatrixRef<T>& v, const gma::Options& opt, gma::Saved<T>* saved) {
  // With a record, one pass over each input takes its fingerprint and probes it (before anything
  // of the record changes, so that a throw leaves it as it was). Without one, the fused
  // bidirectional forward leaves the probes to the kernels (gma_probe_on_failure); the other
  // paths probe the inputs first.
  bool late_probes = false;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value)
    late_probes = saved == nullptr && opt.check_finite && !opt.causal;
#endif
  gma_check_inputs(fn, mix, q, k, v, opt,
                   saved == nullptr && !late_probes ? InputValues::check : InputValues::skip);
  std::uint64_t fingerprints[3];
  if (saved) gma_fingerprint_inputs<T>(fn, q, k, v, opt.check_finite, fingerprints);
  const std::uint64_t* input_fp = saved ? fingerprints : nullptr;
  const FlushSubnormals flush;
  using W = wide_t<T>;
  const Index N = q.rows(), K = mix.components(), d_v = v.cols();
  const T eps = static_cast<T>(opt.eps);
  const GmaForwardBuffers<T> b = gma_forward_buffers<T>(saved);
  GmaForwardScratch<T>& s = b.scratch;
  if (saved) saved->valid = false;
  mixture_constants_into<W>(s.constants, mix.var_raw, mix.prior_logit, mix.var_floor);
  pack_density_into<Arch>(s.packed, mix.mean, s.constants);
  out.resize(N, d_v);
  b.den.resize(N);
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    if (!opt.causal) {
      gma_probe_on_failure<T>(late_probes, fn, q, k, v, [&] {
        gma_bidirectional_fused<Arch, T>(s.packed, q, k, v, eps, opt.check_finite, fn,
                                         saved ? GammaRows::whole : GammaRows::blocks, b.block_q,
                                         b.block_k, b.vt, b.z, out, b.den, s);
        const bool bounded = opt.check_finite && gma_bidirectional_output_bounded(b.vt, b.den);
        gma_forward_finish(fn, out, q, k, v, opt, mix, saved, input_fp, bounded);
      });
      return;
    }
  }
#endif
  if (opt.causal && !saved) {
    gma_causal_forward_blocks<Arch, T>(fn, s, q, k, v, opt, out, b.den);
    gma_forward_finish(fn, out, q, k, v, opt, mix, saved, nullptr);
    return;
  }
  b.gamma_q.resize(N, K);
  b.gamma_k.resize(k.rows(), K);
  gma_gamma_into<Arch, T>(s.packed, q, b.gamma_q.data(), opt.check_finite, fn, "q", &s.scores);
  gma_gamma_into<Arch, T>(s.packed, k, b.gamma_k.data(), opt.check_finite, fn, "k", &s.scores);
  if (opt.causal) {
    s.scan.S.setZero(K, d_v);
    s.scan.z.setZero(K);
    causal_scan_forward<T, Arch>(b.gamma_q, b.gamma_k, v, eps, gma_chunk(opt), out, b.den, s.scan.S,
                                 s.scan.z, s.scan);
  } else {
    gma_bidirectional_forward<T>(b.gamma_q, b.gamma_k, v, eps, b.vt, b.z, out, b.den, s);
  }
  gma_forward_finish(fn, out, q, k, v, opt, mix, saved, input_fp);
}

/// Wide scratch of the one-token decode kernel, per thread (d_v + 2K).
template <class W>
Vector<W>& gma_decode_scratch() {
  thread_local Vector<W> buffer;
  return buffer;
}

/// With checks on, whether v holds values that may make a continued forward's sums overflow.
/// The state holds weighted sums of v's rows in the wide type (z only weights): values below
/// sqrt(max T) cannot overflow it (not even over 2^63 tokens), and cannot carry a sum that is
/// already near the limit over it either, since they are below half its rounding step there.
template <class T>
bool gma_large_values(const ConstMatrixRef<T>& v, const gma::Options& opt) {
  if (!opt.check_finite || v.size() == 0) return false;
  return static_cast<double>(v.cwiseAbs().maxCoeff()) >
         std::sqrt(static_cast<double>(std::numeric_limits<T>::max()));
}

/// With checks on, a continued forward whose output or (after large values) new state
/// overflowed restores the start state when it kept it and throws domain_error. The output, a
/// weighted mean of values, is always probed (O(n d_v)); the state (O(K d_v)) only after large
/// values, so that decoding ordinary tokens pays no extra pass over it.
template <class T>
void gma_check_continued(const char* fn, const Matrix<T>& out, gma::State<T>& st, bool large,
                         bool kept, const Matrix<wide_t<T>>& start_S,
                         const Vector<wide_t<T>>& start_z, Index start_tokens) {
  const bool out_finite = all_finite(out), state_finite = !large || all_finite(st.S);
  if (out_finite && state_finite) return;
  if (kept) {
    st.S = start_S;
    st.z = start_z;
    st.tokens_seen = start_tokens;
  }
  // Decided on the flags above, not on st.S, which holds the (finite) start state again by now:
  // an end state that overflowed under a finite output (the chunked scan reads the start state,
  // not the end one) must throw rather than return with the state silently rewound.
  require_finite_result(out, fn, "the output", "v is");
  if (!state_finite)
    raise_domain_error(concat(fn, ": the state's S overflows ", scalar_name<wide_t<T>>(),
                              " although every input is finite: v is too large for the scalar "
                              "type (scale it down or use double)"));
}

/// Causal forward continuing `st` (SPEC 1.4) for a mixture already packed, into out (n x d_v);
/// validated by the caller. Short pieces (fewer tokens than a chunk: decoding) take the
/// one-token recurrence on the wide state, longer ones the chunked scan; both are the same sums
/// up to rounding. Working memory lives in `saved` (or this thread's scratch without it).
template <class Arch, class T>
void gma_forward_continued(const char* fn, Matrix<T>& out, const PackedDensity<T>& p,
                           const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                           const ConstMatrixRef<T>& v, const gma::Options& opt, gma::State<T>& st,
                           gma::Saved<T>* saved, std::uint64_t mixture_fingerprint) {
  const FlushSubnormals flush;
  using W = wide_t<T>;
  const Index N = q.rows(), K = p.components, d_v = v.cols(), chunk = gma_chunk(opt);
  const GmaForwardBuffers<T> b = gma_forward_buffers<T>(saved);
  GmaForwardScratch<T>& s = b.scratch;
  if (saved) saved->valid = false;
  Matrix<T>& gq = b.gamma_q;
  Matrix<T>& gk = b.gamma_k;
  gq.resize(N, K);
  gk.resize(N, K);
  // Rows far from every component fall back to a wider type; a throw here leaves st untouched.
  gma_gamma_into<Arch, T>(p, q, gq.data(), opt.check_finite, fn, "q", &s.scores);
  gma_gamma_into<Arch, T>(p, k, gk.data(), opt.check_finite, fn, "k", &s.scores);
  out.resize(N, d_v);
  Vector<T>& den = b.den;
  den.resize(N);
  // The start state, for backward or to give it back untouched after an overflow (capacity
  // reused when shapes repeat).
  const Index start_tokens = st.tokens_seen;
  const bool large = gma_large_values<T>(v, opt), kept = large || saved != nullptr;
  Matrix<W>& start_S = b.start_S;
  Vector<W>& start_z = b.start_z;
  if (kept) {
    start_S = st.S;
    start_z = st.z;
  }
  if (N < chunk) {
    Vector<W>& w = gma_decode_scratch<W>();
    w.resize(d_v + 2 * K);
    causal_scan_tokens<T>(gq.data(), gk.data(), v.data(), v.outerStride(), N, K, d_v,
                          static_cast<T>(opt.eps), st.S, st.z, w, out.data(), d_v, den.data());
  } else {
    causal_scan_forward<T, Arch>(gq, gk, v, static_cast<T>(opt.eps), chunk, out, den, st.S, st.z,
                                 s.scan);
  }
  st.tokens_seen += N;
  if (opt.check_finite)
    gma_check_continued<T>(fn, out, st, large, kept, start_S, start_z, start_tokens);
  if (saved) {
    saved->vt.resize(0, 0);
    saved->z.resize(0);
    saved->continued = true;
    gma_save(*saved, out, q, k, v, opt, mixture_fingerprint);
    saved->end_fingerprint = gma_state_fingerprint(st.S, st.z);
  }
}

/// Whether two plain matrices or vectors hold the same shape and the same bits.
template <class D>
bool same_bits(const Eigen::PlainObjectBase<D>& a, const Eigen::PlainObjectBase<D>& b) {
  using S = typename D::Scalar;
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 ||
          std::memcmp(a.data(), b.data(), sizeof(S) * static_cast<std::size_t>(a.size())) == 0);
}

/// The preparations of the continued forward's Mixture overloads at an instruction set other
/// than the default one (a State holds the default one's), one mixture per thread.
template <class Arch, class T>
GmaPreparedMixture<T>& gma_thread_prepared_mixture() {
  thread_local GmaPreparedMixture<T> prepared;
  return prepared;
}

/// `c` made the preparation of `mix` (validated as gma_check_mixture does; its values only when
/// they were not checked before): kept when mix has the bits it was prepared from, prepared again
/// otherwise. Exact either way: equal bits give equal constants. A throw leaves c as it was.
template <class Arch, class T>
const GmaPreparedMixture<T>& gma_prepare_mixture(GmaPreparedMixture<T>& c,
                                                 const gma::Mixture<T>& mix, const char* fn,
                                                 bool check_finite) {
  const bool same = c.valid && same_bits(c.mean, mix.mean) && same_bits(c.var_raw, mix.var_raw) &&
                    same_bits(c.prior_logit, mix.prior_logit) &&
                    std::memcmp(&c.var_floor, &mix.var_floor, sizeof(T)) == 0;
  if (same && (c.checked_finite || !check_finite)) return c;
  gma_check_mixture(mix, fn, check_finite);
  c.checked_finite = check_finite;
  if (same) return c;
  c.valid = false;
  c.mean = mix.mean;
  c.var_raw = mix.var_raw;
  c.prior_logit = mix.prior_logit;
  c.var_floor = mix.var_floor;
  mixture_constants_into<wide_t<T>>(c.constants, mix.var_raw, mix.prior_logit, mix.var_floor);
  pack_density_into<Arch>(c.packed, mix.mean, c.constants);
  c.fingerprinted = false;
  c.valid = true;
  return c;
}

/// The Mixture overloads of the continued forward: gma_forward_continued on the mixture as the
/// state last saw it prepared (prepared again when it changed), with the checks, in their order,
/// of the overloads that prepared it on every call.
template <class Arch, class T>
void gma_forward_state_into(const char* fn, Matrix<T>& out, const gma::Mixture<T>& mix,
                            const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                            const ConstMatrixRef<T>& v, const gma::Options& opt, gma::State<T>& st,
                            gma::Saved<T>* saved) {
  GmaPreparedMixture<T>& c = std::is_same<Arch, simd_arch>::value
                                 ? st.prepared_mixture
                                 : gma_thread_prepared_mixture<Arch, T>();
  gma_prepare_mixture<Arch, T>(c, mix, fn, opt.check_finite);  // validates mix first
  gma_check_qkv<T>(fn, mix.dim(), q, k, v, opt);
  gma_check_state(fn, st, mix.components(), v.cols(), q.rows(), opt);
  if (saved && !c.fingerprinted) {
    c.fingerprint = mixture_fingerprint(mix);
    c.fingerprinted = true;
  }
  gma_forward_continued<Arch, T>(fn, out, c.packed, q, k, v, opt, st, saved, c.fingerprint);
}

/// The Prepared overloads of the continued forward: gma_forward_continued on a mixture prepared
/// once (gma::Prepared, `prep`), after the checks of q, k, v and the state.
template <class Arch, class T, class Prepared>
void gma_forward_prepared_into(const char* fn, Matrix<T>& out, const Prepared& prep,
                               const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                               const ConstMatrixRef<T>& v, const gma::Options& opt,
                               gma::State<T>& st, gma::Saved<T>* saved) {
  gma_check_qkv<T>(fn, prep.dim(), q, k, v, opt);
  gma_check_state(fn, st, prep.components(), v.cols(), q.rows(), opt);
  gma_forward_continued<Arch, T>(fn, out, prep.packed(), q, k, v, opt, st, saved,
                                 prep.mixture_fingerprint());
}

}  // namespace detail
MIXATTN_END_NAMESPACE
