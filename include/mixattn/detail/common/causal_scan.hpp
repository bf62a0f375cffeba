// mixattn/detail/common/causal_scan.hpp — the one chunk-wise causal linear-attention scan of the
// library (SPEC 1.4, 1.5, 4.2): with non-negative features f_q, f_k (rows of N x K matrices) it
// computes out_i = (f_q,i^T sum_{j<=i} f_k,j v_j^T) / (f_q,i . sum_{j<=i} f_k,j + eps) and its
// backward to f_q, f_k and v. GMA passes its responsibilities (K components); linear attention,
// Performer and VQ attention their feature maps (detail/common/feature_attention.hpp).
//
// Inside a chunk of C tokens the C x C lower-triangular block of Gamma_Q Gamma_K^T is formed
// explicitly; across chunks one running state [S | z] (K x d_v and K) carries the prefix. The
// state is accumulated in wide_t<T> (double for float): it sums N terms, and a float running sum
// drifts by O(N eps) relative, while the chunk-local sums (C terms) stay in T and go through
// Eigen's GEMM. Nothing of size N x N or one state per position is ever stored.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/common_types.hpp"
#include "mixattn/core.hpp"
#include "mixattn/detail/common/row_tiles.hpp"
#include "mixattn/detail/common/simd.hpp"
#include "mixattn/detail/common/softmax.hpp"

#include <Eigen/Core>

#include <algorithm>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Default chunk length: small chunks waste less of the masked C x C block; below 32 the GEMMs get
/// too thin to gain (the sweep: bench/results/tuning.md, "GMA causal chunk length").
constexpr Index default_scan_chunk = 32;

/// An option's chunk length, 0 meaning the default.
constexpr Index resolved_chunk(Index chunk) {
  return chunk > 0 ? chunk : default_scan_chunk;
}

/// Sizes the scan's T buffers (the wide states are set by the callers); the forward and the
/// backward size them alike, so that a scratch shared by both keeps its memory.
template <class T>
void reset_scan_scratch(ScanScratch<T>& s, Index K, Index d_v, Index chunk) {
  const Index padded = padded_to_vectors<T>(chunk);
  s.s_t.resize(K, d_v);
  s.update.resize(K, d_v);
  s.z_t.resize(K);
  s.z_update.resize(K);
  s.a_buf.resize(chunk, padded);
  s.b_buf.resize(chunk, padded);
  s.gkt.resize(K, padded);
  s.vt.resize(d_v, padded);
  s.st.resize(d_v, K);
}

/// Causal forward (SPEC 1.4). gq, gk: N x K responsibilities; v: N x d_v. [S | z] (K x d_v, K,
/// wide) is the prefix state before the first token on entry (zero for a whole sequence) and
/// after the last on exit. Writes out (N x d_v) and den (N) = gamma_q,i . z_i + eps.
/// SIMD builds read each chunk out and write its state update with row_tiles.hpp's register
/// tiles (the state and the chunk's values stream through L1, nothing is packed); the scalar
/// build, and the C x C block in both, use Eigen's products.
template <class T, class Arch = simd_arch>
void causal_scan_forward(const ConstMatrixRef<T>& gq, const ConstMatrixRef<T>& gk,
                         const ConstMatrixRef<T>& v, T eps, Index chunk, MatrixRef<T> out,
                         Eigen::Ref<Vector<T>> den, Matrix<wide_t<T>>& S, Vector<wide_t<T>>& z,
                         ScanScratch<T>& scratch) {
  using W = wide_t<T>;
  const Index N = gq.rows(), K = gq.cols(), d_v = v.cols(), ldo = out.outerStride();
  const Index ldq = gq.outerStride(), ldk = gk.outerStride();
  reset_scan_scratch(scratch, K, d_v, chunk);
  Matrix<T>& s_t = scratch.s_t;
  Matrix<T>& update = scratch.update;
  Vector<T>& z_t = scratch.z_t;
  Matrix<T>& a_buf = scratch.a_buf;
  s_t = S.template cast<T>();
  z_t = z.template cast<T>();
  for (Index s = 0; s < N; s += chunk) {
    const Index c = std::min(chunk, N - s);
    const ConstMatrixRef<T> gqc = gq.middleRows(s, c), gkc = gk.middleRows(s, c);
    const ConstMatrixRef<T> vc = v.middleRows(s, c);
    Eigen::Map<Matrix<T>> a(a_buf.data(), c, c);
#if MIXATTN_HAS_SIMD
    if constexpr (!std::is_same<Arch, scalar_arch>::value) {
      // A = Gamma_Q,R Gamma_K,R^T as a read of the chunk's Gamma_K^T (K x c), undivided
      transpose_padded<T>(gkc, scratch.gkt.data(), c);
      read_block<Arch, T>(ReadSources<T>{gqc.data(), ldq, scratch.gkt.data(), c, K}, c, c, nullptr,
                          a.data(), c);
      for (Index i = 0; i + 1 < c; ++i)  // token i sees j <= i
        std::fill(a.data() + i * c + i + 1, a.data() + (i + 1) * c, T(0));
      dot_rows(Arch{}, gqc.data(), ldq, c, K, z_t.data(), eps, den.data() + s);
      for (Index i = 0; i < c; ++i) den(s + i) += a.row(i).sum();
      const Index ldv = v.outerStride();
      read_block<Arch, T>(
          ReadSources<T>{gqc.data(), ldq, s_t.data(), d_v, K, a.data(), c, vc.data(), ldv, c}, c,
          d_v, den.data() + s, out.data() + s * ldo, ldo);
      // S += Gamma_K,R^T V_R in W, with its T copy for the next chunk's read
      state_update<Arch>(gkc.data(), ldk, vc.data(), ldv, c, K, d_v, S.data(), s_t.data());
      Eigen::Map<Vector<T>> zc(scratch.z_update.data(), K);
      zc.setZero();
      add_rows(Arch{}, gkc.data(), ldk, c, K, zc.data());
      z += zc.template cast<W>();
      z_t = z.template cast<T>();
      continue;
    }
#endif
    a.noalias() = gqc * gkc.transpose();
    a.template triangularView<Eigen::StrictlyUpper>().setZero();  // token i sees j <= i
    MatrixRef<T> oc = out.middleRows(s, c);
    oc.noalias() = gqc * s_t;
    oc.noalias() += a * vc;
    den.segment(s, c).noalias() = gqc * z_t;
    den.segment(s, c).array() += a.rowwise().sum().array() + eps;
    oc.array().colwise() /= den.segment(s, c).array();
    // state after the chunk
    update.noalias() = gkc.transpose() * vc;
    S += update.template cast<W>();
    z += gkc.colwise().sum().transpose().template cast<W>();
    s_t = S.template cast<T>();
    z_t = z.template cast<T>();
  }
}

/// The same recurrence one token at a time, read straight from the wide state: for token i,
///   S += gamma_k,i v_i^T,  z += gamma_k,i,  out_i = (gamma_q,i S) / (gamma_q,i . z + eps).
/// One pass over S per token, the write and the read fused: for each block of 16 value columns
/// the block of v and the block of the read-out stay in registers while the K rows stream by.
/// No T copy of the state: the decode path, where a chunk's GEMMs would be 1 x K.
/// w: wide scratch of at least d_v + 2K. Writes out (n x d_v, stride ldo) and den (n).
template <class T>
void causal_scan_tokens(const T* gq, const T* gk, const T* v, Index ldv, Index n, Index K,
                        Index d_v, T eps, Matrix<wide_t<T>>& S, Vector<wide_t<T>>& z,
                        Vector<wide_t<T>>& w, T* out, Index ldo, T* den) {
  using W = wide_t<T>;
  constexpr int B = 16;
  using Block = Eigen::Matrix<W, B, 1>;
  W* vw = w.data();
  W* kw = vw + d_v;
  W* qw = kw + K;
  W* s = S.data();
  for (Index i = 0; i < n; ++i) {
    for (Index c = 0; c < d_v; ++c) vw[c] = static_cast<W>(v[i * ldv + c]);
    for (Index c = 0; c < K; ++c) {
      kw[c] = static_cast<W>(gk[i * K + c]);
      qw[c] = static_cast<W>(gq[i * K + c]);
    }
    Eigen::Map<Vector<W>>(z.data(), K) += Eigen::Map<const Vector<W>>(kw, K);
    const W dw = Eigen::Map<const Vector<W>>(qw, K).dot(z) + static_cast<W>(eps);
    T* o = out + i * ldo;
    Index j = 0;
    for (; j + B <= d_v; j += B) {
      const Block vb = Eigen::Map<const Block>(vw + j);
      Block acc = Block::Zero();
      for (Index c = 0; c < K; ++c) {
        Eigen::Map<Block> row(s + c * d_v + j);
        row += kw[c] * vb;
        acc += qw[c] * row;
      }
      for (int l = 0; l < B; ++l) o[j + l] = static_cast<T>(acc[l] / dw);
    }
    for (; j < d_v; ++j) {  // columns beyond the last full block
      W acc = 0;
      for (Index c = 0; c < K; ++c) {
        W& e = s[c * d_v + j];
        e += kw[c] * vw[j];
        acc += qw[c] * e;
      }
      o[j] = static_cast<T>(acc / dw);
    }
    den[i] = static_cast<T>(dw);
  }
}

/// The query side of the causal backward (SPEC 1.5) through Eigen's products, prefix order:
/// dgamma_q,i = S_i g_i + h_i z_i, with [S | z] from the start state (S0, z0; null: zero).
template <class T>
void causal_scan_query_eigen(const Matrix<T>& gk, const ConstMatrixRef<T>& v, const Matrix<T>& g,
                             const Vector<T>& h, Index chunk, Matrix<T>& dgq,
                             const Matrix<wide_t<T>>* S0, const Vector<wide_t<T>>* z0,
                             ScanScratch<T>& scratch) {
  using W = wide_t<T>;
  const Index N = gk.rows(), K = gk.cols(), d_v = v.cols();
  Matrix<W>& S = scratch.S;
  Vector<W>& z = scratch.z;
  Matrix<T>& s_t = scratch.s_t;
  Vector<T>& z_t = scratch.z_t;
  if (S0 != nullptr) {
    S = *S0;
    z = *z0;
  } else {
    S.setZero(K, d_v);
    z.setZero(K);
  }
  s_t = S.template cast<T>();
  z_t = z.template cast<T>();
  for (Index s = 0; s < N; s += chunk) {
    const Index c = std::min(chunk, N - s);
    const ConstMatrixRef<T> gkc = gk.middleRows(s, c), vc = v.middleRows(s, c);
    const ConstMatrixRef<T> gc = g.middleRows(s, c);
    Eigen::Map<Matrix<T>> b(scratch.b_buf.data(), c, c);
    b.noalias() = gc * vc.transpose();
    b.colwise() += h.segment(s, c);
    b.template triangularView<Eigen::StrictlyUpper>().setZero();
    MatrixRef<T> dq = dgq.middleRows(s, c);
    dq.noalias() = gc * s_t.transpose();
    dq.noalias() += h.segment(s, c) * z_t.transpose();
    dq.noalias() += b * gkc;
    scratch.update.noalias() = gkc.transpose() * vc;
    S += scratch.update.template cast<W>();
    z += gkc.colwise().sum().transpose().template cast<W>();
    s_t = S.template cast<T>();
    z_t = z.template cast<T>();
  }
}

/// The key side through Eigen's products, suffix order: dgamma_k,j = G_j v_j + u_j, dv_j = G_j^T
/// gamma_k,j, with [G | u] the gradient of the end state on entry, of the start state on exit.
template <class T>
void causal_scan_key_eigen(const Matrix<T>& gq, const Matrix<T>& gk, const ConstMatrixRef<T>& v,
                           const Matrix<T>& g, const Vector<T>& h, Index chunk, Matrix<T>& dgk,
                           Matrix<T>& dv, Matrix<wide_t<T>>& G, Vector<wide_t<T>>& u,
                           ScanScratch<T>& scratch) {
  using W = wide_t<T>;
  const Index N = gq.rows();
  Matrix<T>& g_t = scratch.s_t;
  Vector<T>& u_t = scratch.z_t;
  g_t = G.template cast<T>();
  u_t = u.template cast<T>();
  const Index chunks = (N + chunk - 1) / chunk;
  for (Index ci = chunks - 1; ci >= 0; --ci) {
    const Index s = ci * chunk, c = std::min(chunk, N - s);
    const ConstMatrixRef<T> gqc = gq.middleRows(s, c), gkc = gk.middleRows(s, c);
    const ConstMatrixRef<T> vc = v.middleRows(s, c), gc = g.middleRows(s, c);
    Eigen::Map<Matrix<T>> b(scratch.b_buf.data(), c, c), a(scratch.a_buf.data(), c, c);
    b.noalias() = gc * vc.transpose();
    b.colwise() += h.segment(s, c);
    b.template triangularView<Eigen::StrictlyUpper>().setZero();
    a.noalias() = gqc * gkc.transpose();
    a.template triangularView<Eigen::StrictlyUpper>().setZero();
    MatrixRef<T> dk = dgk.middleRows(s, c), dvc = dv.middleRows(s, c);
    dk.noalias() = vc * g_t.transpose();
    dk.rowwise() += u_t.transpose();
    dk.noalias() += b.transpose() * gqc;
    dvc.noalias() = gkc * g_t;
    dvc.noalias() += a.transpose() * gc;
    scratch.update.noalias() = gqc.transpose() * gc;
    G += scratch.update.template cast<W>();
    scratch.z_update.noalias() = gqc.transpose() * h.segment(s, c);
    u += scratch.z_update.template cast<W>();
    g_t = G.template cast<T>();
    u_t = u.template cast<T>();
  }
}

#if MIXATTN_HAS_SIMD
/// One chunk of the causal backward's operands: rows [s, s + c) of Gamma_Q, Gamma_K, V, g and h.
template <class T>
struct CausalChunk {
  const T *gq, *gk, *v, *g, *h;
  Index ldq, ldk, ldv, ldg, c, K, d_v;
  /// Column count of the chunk's transposed operands and C x C blocks: whole registers of Arch.
  template <class Arch>
  Index ld() const {
    constexpr Index Wd = static_cast<Index>(simd_width<Arch, T>::value);
    return (c + Wd - 1) / Wd * Wd;
  }
};

/// dst = the c x n rows of x (stride ldx) transposed: n rows of stride ld, zero beyond c.
template <class T>
inline void transpose_rows(const T* x, Index ldx, Index c, Index n, T* dst, Index ld) {
  const Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> m(x, c, n, Eigen::OuterStride<>(ldx));
  transpose_padded<T>(m, dst, ld);
}

/// out[i, j] = [j <= i] (x_i . y_j + add_i) for the n x ld block of a chunk (x: n rows of d,
/// stride ldx; yt = y^T: d rows of stride ld, zero beyond n; add: n entries or null): the
/// lower triangle of a chunk's block and zeros. A tile of rows computes the registers of columns
/// up to its last row only.
template <class Arch, class T>
inline void causal_block(const T* x, Index ldx, const T* yt, Index ld, Index d, Index n,
                         const T* add, T* out) {
  constexpr Index Wd = static_cast<Index>(simd_width<Arch, T>::value);
  sum_block<Arch, T>(n, out, ld, [&](Index i0, Index rows, Term<T>(&t)[3]) {
    t[0] = Term<T>{x + i0 * ldx, ldx, 1, yt, ld, d};
    return std::min(ld, (i0 + rows + Wd - 1) / Wd * Wd);
  });
  for (Index i = 0; i < n; ++i) {
    T* row = out + i * ld;
    if (add != nullptr)
      for (Index j = 0; j <= i; ++j) row[j] += add[i];
    std::fill(row + i + 1, row + ld, T(0));
  }
}

/// The query side of one chunk on register tiles (the Eigen twin's products, fused per row tile):
///   B = mask(g V^T + h 1^T),  dGamma_Q = g S^T + h z^T + B Gamma_K,
/// then S^T += V^T Gamma_K and z += Gamma_K^T 1. The prefix state is kept transposed (d_v x K:
/// wide in s.S, in T in s.st), so that every product streams rows of its operands.
template <class Arch, class T>
inline void causal_backward_query_chunk(const CausalChunk<T>& ch, ScanScratch<T>& s, T* dq,
                                        Index lddq) {
  using W = wide_t<T>;
  const Index c = ch.c, K = ch.K, d_v = ch.d_v, ld = ch.template ld<Arch>();
  transpose_rows<T>(ch.v, ch.ldv, c, d_v, s.vt.data(), ld);
  causal_block<Arch, T>(ch.g, ch.ldg, s.vt.data(), ld, d_v, c, ch.h, s.b_buf.data());
  const T* b = s.b_buf.data();
  sum_block<Arch, T>(c, dq, lddq, [&](Index i0, Index rows, Term<T>(&t)[3]) {
    t[0] = Term<T>{ch.g + i0 * ch.ldg, ch.ldg, 1, s.st.data(), K, d_v};
    t[1] = Term<T>{ch.h + i0, 1, 0, s.z_t.data(), 0, 1};
    t[2] = Term<T>{b + i0 * ld, ld, 1, ch.gk, ch.ldk, std::min(c, i0 + rows)};
    return K;
  });
  state_update<Arch>(ch.v, ch.ldv, ch.gk, ch.ldk, c, d_v, K, s.S.data(), s.st.data());
  Eigen::Map<Vector<T>> zc(s.z_update.data(), K);
  zc.setZero();
  add_rows(Arch{}, ch.gk, ch.ldk, c, K, zc.data());
  s.z += zc.template cast<W>();
  s.z_t = s.z.template cast<T>();
}

/// The key side of one chunk on register tiles, with A = mask(Gamma_Q Gamma_K^T):
///   dGamma_K = V G^T + 1 u^T + B^T Gamma_Q,  dV = Gamma_K G + A^T g,
/// then G += Gamma_Q^T g, u += Gamma_Q^T h. G's T copy is kept both ways (s.s_t: K x d_v, s.st:
/// d_v x K), one for each of the two products that read it.
template <class Arch, class T>
inline void causal_backward_key_chunk(const CausalChunk<T>& ch, Matrix<wide_t<T>>& G,
                                      Vector<wide_t<T>>& u, ScanScratch<T>& s, T* dk, Index lddk,
                                      T* dv, Index lddv) {
  using W = wide_t<T>;
  static const T one = T(1);
  const Index c = ch.c, K = ch.K, d_v = ch.d_v, ld = ch.template ld<Arch>();
  transpose_rows<T>(ch.v, ch.ldv, c, d_v, s.vt.data(), ld);
  causal_block<Arch, T>(ch.g, ch.ldg, s.vt.data(), ld, d_v, c, ch.h, s.b_buf.data());
  transpose_rows<T>(ch.gk, ch.ldk, c, K, s.gkt.data(), ld);
  causal_block<Arch, T>(ch.gq, ch.ldq, s.gkt.data(), ld, K, c, nullptr, s.a_buf.data());
  const T *b = s.b_buf.data(), *a = s.a_buf.data();
  // column j of B and A holds its nonzeros from row j on
  sum_block<Arch, T>(c, dk, lddk, [&](Index j0, Index, Term<T>(&t)[3]) {
    t[0] = Term<T>{ch.v + j0 * ch.ldv, ch.ldv, 1, s.st.data(), K, d_v};
    t[1] = Term<T>{&one, 0, 0, s.z_t.data(), 0, 1};
    t[2] = Term<T>{b + j0 * ld + j0, 1, ld, ch.gq + j0 * ch.ldq, ch.ldq, c - j0};
    return K;
  });
  sum_block<Arch, T>(c, dv, lddv, [&](Index j0, Index, Term<T>(&t)[3]) {
    t[0] = Term<T>{ch.gk + j0 * ch.ldk, ch.ldk, 1, s.s_t.data(), d_v, K};
    t[1] = Term<T>{a + j0 * ld + j0, 1, ld, ch.g + j0 * ch.ldg, ch.ldg, c - j0};
    return d_v;
  });
  state_update<Arch>(ch.gq, ch.ldq, ch.g, ch.ldg, c, K, d_v, G.data(), s.s_t.data());
  transpose_padded<T>(s.s_t, s.st.data(), K);
  Eigen::Map<Vector<T>> uc(s.z_update.data(), K);
  uc.setZero();
  for (Index i = 0; i < c; ++i) uc += ch.h[i] * Eigen::Map<const Vector<T>>(ch.gq + i * ch.ldq, K);
  u += uc.template cast<W>();
  s.z_t = u.template cast<T>();
}

/// The causal backward on register tiles (SIMD builds): the query side's chunks in prefix order,
/// then the key side's in suffix order, each chunk's products read while its rows are in L1.
template <class Arch, class T>
void causal_scan_backward_tiles(const Matrix<T>& gq, const Matrix<T>& gk,
                                const ConstMatrixRef<T>& v, const Matrix<T>& g, const Vector<T>& h,
                                Index chunk, Matrix<T>& dgq, Matrix<T>& dgk, Matrix<T>& dv,
                                const Matrix<wide_t<T>>* S0, const Vector<wide_t<T>>* z0,
                                Matrix<wide_t<T>>& G, Vector<wide_t<T>>& u,
                                ScanScratch<T>& scratch) {
  const Index N = gq.rows(), K = gq.cols(), d_v = v.cols();
  if (S0 != nullptr) {
    scratch.S = S0->transpose();
    scratch.z = *z0;
  } else {
    scratch.S.setZero(d_v, K);
    scratch.z.setZero(K);
  }
  scratch.st = scratch.S.template cast<T>();
  scratch.z_t = scratch.z.template cast<T>();
  const auto chunk_at = [&](Index s) {
    return CausalChunk<T>{gq.data() + s * K,
                          gk.data() + s * K,
                          v.data() + s * v.outerStride(),
                          g.data() + s * d_v,
                          h.data() + s,
                          K,
                          K,
                          v.outerStride(),
                          d_v,
                          std::min(chunk, N - s),
                          K,
                          d_v};
  };
  for (Index s = 0; s < N; s += chunk)
    causal_backward_query_chunk<Arch>(chunk_at(s), scratch, dgq.data() + s * K, K);
  scratch.s_t = G.template cast<T>();
  transpose_padded<T>(scratch.s_t, scratch.st.data(), K);
  scratch.z_t = u.template cast<T>();
  for (Index s = (N - 1) / chunk * chunk; s >= 0 && N > 0; s -= chunk)
    causal_backward_key_chunk<Arch>(chunk_at(s), G, u, scratch, dgk.data() + s * K, K,
                                    dv.data() + s * d_v, d_v);
}
#endif

/// Causal backward to Gamma_Q, Gamma_K and V (SPEC 1.5). g = dO / den (N x d_v), h (N).
/// Query side: a forward pass over chunks with the prefix state (S, z), starting from the
/// forward's start state (S0, z0; null: zero); key side: a backward pass with the suffix state
/// (G, u) = (dS_T, dz_T) + sum_{i >= j} (gamma_q,i g_i^T, h_i gamma_q,i), starting from the
/// gradient of the end state [G | u] on entry; on exit [G | u] = (dS0, dz0), the gradient of the
/// start state (SPEC 1.5, pieces). In a chunk, B_ij = [j <= i] (g_i . v_j + h_i) gives
/// dGamma_Q += B Gamma_K and dGamma_K += B^T Gamma_Q. dgq, dgk (N x K) and dv (N x d_v) are
/// sized by the caller. SIMD builds run each chunk on row_tiles.hpp's register tiles
/// (causal_scan_backward_tiles); the scalar build (and Arch = scalar_arch, its twin in the tests)
/// on Eigen's products. Both keep the running states wide (see the top of this file).
template <class T, class Arch = simd_arch>
void causal_scan_backward(const Matrix<T>& gq, const Matrix<T>& gk, const ConstMatrixRef<T>& v,
                          const Matrix<T>& g, const Vector<T>& h, Index chunk, Matrix<T>& dgq,
                          Matrix<T>& dgk, Matrix<T>& dv, const Matrix<wide_t<T>>* S0,
                          const Vector<wide_t<T>>* z0, Matrix<wide_t<T>>& G, Vector<wide_t<T>>& u,
                          ScanScratch<T>& scratch) {
  reset_scan_scratch(scratch, gq.cols(), v.cols(), chunk);
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    causal_scan_backward_tiles<Arch, T>(gq, gk, v, g, h, chunk, dgq, dgk, dv, S0, z0, G, u,
                                        scratch);
    return;
  }
#endif
  causal_scan_query_eigen<T>(gk, v, g, h, chunk, dgq, S0, z0, scratch);
  causal_scan_key_eigen<T>(gq, gk, v, g, h, chunk, dgk, dv, G, u, scratch);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
