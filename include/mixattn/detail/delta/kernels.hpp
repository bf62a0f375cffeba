// mixattn/detail/delta/kernels.hpp — the gated delta rule's register-tiled kernels (SPEC.md §9):
// one chunk's products, which are small (C = 64 rows against d_k, d_v ~ 64-256 columns, every
// operand in L1 or L2) and often triangular, and the decoding step on the wide state.
//
//   delta_product   C (+)= op(A) B for row-major B and C, op(A) = A or A^T, with op(A) lower or
//                   upper triangular (its zero half is skipped) and, optionally, only the tiles of
//                   C that reach its lower triangle: no packing (every operand is read where it
//                   lies), MR x NR registers of C per tile while the rows of B stream through
//   delta_decode_*  one token of the recurrence (SPEC 9.1) on the wide state, strip of columns by
//                   strip: S^T [k q] from one read, then alpha S + k delta^T written while the
//                   strip is in L1, with the finiteness of what was read and written
//
// Tile sizes are compile-time choices (bench/results/tuning.md). Builds without SIMD, and
// operands whose rows are not whole registers, use Eigen's products instead.
//
// Internal: included by mixattn/delta.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/common/simd.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// The structure of op(A) in delta_product: none, lower (op(A)[i][p] = 0 for p > i) or upper
/// (op(A)[i][p] = 0 for p < i). The zero half must hold zeros: a tile that straddles the diagonal
/// reads it.
enum class DeltaTri { none, lower, upper };

/// op(A) (m x k) of delta_product: row-major storage `a` with row stride lda, read as A (m x k)
/// or, with trans, as the transpose of a k x m matrix.
template <class T>
struct DeltaLhs {
  const T* a;
  Index lda;
  bool trans;
  DeltaTri tri;
};

template <class T>
DeltaLhs<T> delta_lhs(const ConstMatrixRef<T>& m, bool trans, DeltaTri tri = DeltaTri::none) {
  return {m.data(), m.outerStride(), trans, tri};
}

#if MIXATTN_HAS_SIMD
/// Rows of C per tile and registers of C per row: 8 x 2 on 32 registers (16 accumulators, two
/// rows of B, one broadcast), 4 x 2 on 16.
template <class Arch>
constexpr int delta_tile_rows() {
  return simd_registers<Arch>() >= 32 ? 8 : 4;
}
constexpr int delta_tile_regs = 2;

/// One tile: rows [i0, i0 + MR) x registers [j0, j0 + NR L) of C, over p in [p0, p1).
template <class Arch, class T, int MR, int NR, bool Trans>
MIXATTN_ALWAYS_INLINE void delta_tile(const T* a, Index lda, const T* b, Index ldb, T* c, Index ldc,
                                      Index i0, Index j0, Index p0, Index p1, bool accumulate) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r)
      acc[i][r] = accumulate ? B::load_unaligned(c + (i0 + i) * ldc + j0 + r * L) : B(T(0));
  for (Index p = p0; p < p1; ++p) {
    B bv[NR];
    for (int r = 0; r < NR; ++r) bv[r] = B::load_unaligned(b + p * ldb + j0 + r * L);
    for (int i = 0; i < MR; ++i) {
      const B ai(Trans ? a[p * lda + i0 + i] : a[(i0 + i) * lda + p]);
      for (int r = 0; r < NR; ++r) acc[i][r] = xsimd::fma(ai, bv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r].store_unaligned(c + (i0 + i) * ldc + j0 + r * L);
}

/// The tiles of one strip of NR registers of C's columns, every row tile.
template <class Arch, class T, int NR, bool Trans>
MIXATTN_ALWAYS_INLINE void delta_strip(const DeltaLhs<T>& op, Index m, Index k, const T* b,
                                       Index ldb, T* c, Index ldc, Index j0, bool accumulate,
                                       bool lower_result) {
  constexpr int MR = delta_tile_rows<Arch>();
  constexpr Index L = static_cast<Index>(xsimd::batch<T, Arch>::size);
  for (Index i0 = 0; i0 < m; i0 += MR) {
    const Index rows = std::min<Index>(MR, m - i0);
    if (lower_result && j0 > i0 + rows - 1) {  // every column of the strip is above the diagonal
      if (!accumulate)
        for (Index i = i0; i < i0 + rows; ++i)
          std::fill(c + i * ldc + j0, c + i * ldc + j0 + NR * L, T(0));
      continue;
    }
    Index p0 = 0, p1 = k;
    if (op.tri == DeltaTri::lower) p1 = std::min(k, i0 + rows);
    if (op.tri == DeltaTri::upper) p0 = std::min(k, i0);
    with_rows<MR>(rows, [&](auto rc) {
      delta_tile<Arch, T, decltype(rc)::value, NR, Trans>(op.a, op.lda, b, ldb, c, ldc, i0, j0, p0,
                                                          p1, accumulate);
    });
  }
}
#endif

/// C (+)= op(A) B (C: m x n, op(A): m x k, B: k x n, row-major, any row strides). op.tri skips
/// op(A)'s zero half; lower_result: only C's tiles that reach its lower triangle (j <= i) are
/// computed, the others are left as they are (accumulate) or zero.
template <class T>
void delta_product(MatrixRef<T> c, const DeltaLhs<T>& op, const ConstMatrixRef<T>& b,
                   bool accumulate, GemmSpace<T>& space, bool lower_result = false) {
  const Index m = c.rows(), n = c.cols(), k = b.rows();
  MIXATTN_ASSERT(b.cols() == n);
#if MIXATTN_HAS_SIMD
  using Arch = simd_arch;
  constexpr Index L = static_cast<Index>(simd_width<Arch, T>::value);
  if (n % L == 0 && !std::is_same<Arch, scalar_arch>::value) {
    if (m == 0 || n == 0) return;
    if (k == 0) {
      if (!accumulate) c.setZero();
      return;
    }
    const auto run = [&](auto trans) {
      constexpr bool Tr = decltype(trans)::value;
      Index j0 = 0;
      for (; j0 + delta_tile_regs * L <= n; j0 += delta_tile_regs * L)
        delta_strip<Arch, T, delta_tile_regs, Tr>(op, m, k, b.data(), b.outerStride(), c.data(),
                                                  c.outerStride(), j0, accumulate, lower_result);
      for (; j0 < n; j0 += L)
        delta_strip<Arch, T, 1, Tr>(op, m, k, b.data(), b.outerStride(), c.data(), c.outerStride(),
                                    j0, accumulate, lower_result);
    };
    if (op.trans)
      run(std::true_type{});
    else
      run(std::false_type{});
    return;
  }
#endif
  static_cast<void>(lower_result);  // the twin computes every entry (the zero half included)
  using Stride = Eigen::OuterStride<>;
  const Index ar = op.trans ? k : m, ac = op.trans ? m : k;
  const Eigen::Map<const Matrix<T>, 0, Stride> a(op.a, ar, ac, Stride(op.lda));
  const GemmOperand<T> lhs = op.trans ? transposed<T>(a) : plain<T>(a);
  product_into<T>(c, lhs, plain<T>(b), T(1), accumulate, space);
}

/// One token of the recurrence (SPEC 9.1) for decoding, on the wide state: its k^, q~ (wide rows
/// of d_k), v (wide, d_v), alpha, beta and k^ . q~; delta and the output row are written to `d`
/// and `o` (wide, d_v).
template <class W>
struct DeltaDecodeToken {
  const W* k;
  const W* q;
  const W* v;
  W alpha, beta, kq;
  W* d;
  W* o;
};

/// What a decoding step saw: every value of the state it read (`read`, the first token's source)
/// and wrote finite, as accumulated x - x (0 or NaN) in registers.
struct DeltaDecodeFinite {
  bool read = true;
  bool written = true;
};

/// The columns [j0, j1) of one decoding step, without SIMD: S^T k and S^T q, delta and the output,
/// then dst = alpha src + k delta^T; `acc` gathers x - x of what was read and written.
template <class W>
void delta_decode_columns(const W* src, W* dst, Index ld, Index dk, Index j0, Index j1,
                          const DeltaDecodeToken<W>& t, W* acc) {
  for (Index j = j0; j < j1; ++j) {
    W sk = 0, sq = 0;
    for (Index i = 0; i < dk; ++i) {
      const W x = src[i * ld + j];
      acc[0] += x - x;
      sk += t.k[i] * x;
      sq += t.q[i] * x;
    }
    t.d[j] = t.beta * (t.v[j] - t.alpha * sk);
    t.o[j] = t.alpha * sq + t.kq * t.d[j];
    for (Index i = 0; i < dk; ++i) {
      const W y = t.alpha * src[i * ld + j] + t.k[i] * t.d[j];
      dst[i * ld + j] = y;
      acc[1] += y - y;
    }
  }
}

#if MIXATTN_HAS_SIMD
/// A strip of NR registers of the state's columns [j0, j0 + NR L) of one decoding step: S^T k and
/// S^T q in one read of the strip's rows, delta and the output for those columns, then the strip
/// of dst = alpha src + k delta^T from a second read, which finds the strip (d_k x NR L) in L1:
/// the state streams through L2 once per token, read and written. Rows go in pairs with sums of
/// their own (even and odd rows), so that no chain of dependent adds sets the pace.
template <class Arch, class W, int NR>
MIXATTN_ALWAYS_INLINE void delta_decode_strip(const W* src, W* dst, Index ld, Index dk, Index j0,
                                              const DeltaDecodeToken<W>& t,
                                              xsimd::batch<W, Arch>* acc) {
  using B = xsimd::batch<W, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  const B zero(W(0));
  B sk[2][NR], sq[2][NR], fin[2][NR];
  for (int e = 0; e < 2; ++e)
    for (int r = 0; r < NR; ++r) sk[e][r] = sq[e][r] = fin[e][r] = zero;
  for (Index i = 0; i < dk; i += 2) {
    for (int e = 0; e < 2; ++e) {
      if (e == 1 && i + 1 == dk) break;
      const W* row = src + (i + e) * ld + j0;
      const B ki(t.k[i + e]), qi(t.q[i + e]);
      for (int r = 0; r < NR; ++r) {
        const B x = B::load_unaligned(row + r * L);
        fin[e][r] += x - x;
        sk[e][r] = xsimd::fma(ki, x, sk[e][r]);
        sq[e][r] = xsimd::fma(qi, x, sq[e][r]);
      }
    }
  }
  const B a(t.alpha), b(t.beta), kq(t.kq);
  B d[NR];
  for (int r = 0; r < NR; ++r) {
    acc[0] += fin[0][r] + fin[1][r];
    fin[0][r] = fin[1][r] = zero;
    d[r] = b * xsimd::fnma(a, sk[0][r] + sk[1][r], B::load_unaligned(t.v + j0 + r * L));
    d[r].store_unaligned(t.d + j0 + r * L);
    xsimd::fma(kq, d[r], a * (sq[0][r] + sq[1][r])).store_unaligned(t.o + j0 + r * L);
  }
  for (Index i = 0; i < dk; i += 2) {
    for (int e = 0; e < 2; ++e) {
      if (e == 1 && i + 1 == dk) break;
      const W* row = src + (i + e) * ld + j0;
      W* out = dst + (i + e) * ld + j0;
      const B ki(t.k[i + e]);
      for (int r = 0; r < NR; ++r) {
        const B y = xsimd::fma(ki, d[r], a * B::load_unaligned(row + r * L));
        y.store_unaligned(out + r * L);
        fin[e][r] += y - y;
      }
    }
  }
  for (int r = 0; r < NR; ++r) acc[1] += fin[0][r] + fin[1][r];
}
#endif

/// One decoding step (SPEC 9.1) over the whole state (d_k x d_v, row stride ld): from src into
/// dst, which may be src itself (each strip is read whole before it is written).
template <class W>
DeltaDecodeFinite delta_decode_step(const W* src, W* dst, Index dk, Index dv, Index ld,
                                    const DeltaDecodeToken<W>& t) {
  Index j0 = 0;
  W tail[2] = {W(0), W(0)};
  DeltaDecodeFinite seen;
#if MIXATTN_HAS_SIMD
  using Arch = simd_arch;
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using B = xsimd::batch<W, Arch>;
    constexpr Index L = static_cast<Index>(B::size);
    // NR L columns by d_k rows stay in L1 between the strip's two reads (16 KiB at d_k = 128,
    // NR = 2, AVX-512 doubles); registers: 2 NR sums, NR of delta.
    constexpr int NR = simd_registers<Arch>() >= 32 ? 2 : 1;
    B acc[2] = {B(W(0)), B(W(0))};
    for (; j0 + NR * L <= dv; j0 += NR * L)
      delta_decode_strip<Arch, W, NR>(src, dst, ld, dk, j0, t, acc);
    for (; j0 + L <= dv; j0 += L) delta_decode_strip<Arch, W, 1>(src, dst, ld, dk, j0, t, acc);
    tail[0] = xsimd::hadd(acc[0]);
    tail[1] = xsimd::hadd(acc[1]);
  }
#endif
  delta_decode_columns<W>(src, dst, ld, dk, j0, dv, t, tail);
  seen.read = tail[0] == W(0);
  seen.written = tail[1] == W(0);
  return seen;
}

/// Columns of the stored T = (I + A)^-1 for chunks of C rows: whole groups of the registers
/// delta_substitute keeps per row, so that its rows' padding holds zeros it can read.
template <class T>
Index delta_tri_width(Index C) {
  constexpr Index G = 4 * static_cast<Index>(simd_width<simd_arch, T>::value);
  return (C + G - 1) / G * G;
}

/// T = (I + A)^-1 for a strictly lower n x n A (rows of stride lda) into t (n rows of stride
/// ldt >= delta_tri_width(n), zeros beyond each row's diagonal, the padding included): row r is
/// t_r = e_r - sum_{j<r} A_rj t_j, summed in registers over groups of 4 registers of columns
/// (t_j is zero beyond column j, so a group starting at c0 takes j >= c0 only). C^3/6 multiply-
/// adds in whole registers.
template <class T>
void delta_substitute(const T* a, Index lda, Index n, T* t, Index ldt) {
#if MIXATTN_HAS_SIMD
  using Arch = simd_arch;
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using B = xsimd::batch<T, Arch>;
    constexpr Index L = static_cast<Index>(B::size), G = 4 * L;
    for (Index r = 0; r < n; ++r) {
      T* tr = t + r * ldt;
      const T* ar = a + r * lda;
      for (Index c0 = 0; c0 < ldt; c0 += G) {
        B acc[4] = {B(T(0)), B(T(0)), B(T(0)), B(T(0))};
        for (Index j = c0; j < r; ++j) {
          const B x(ar[j]);
          const T* tj = t + j * ldt + c0;
          for (int g = 0; g < 4; ++g)
            acc[g] = xsimd::fnma(x, B::load_unaligned(tj + g * L), acc[g]);
        }
        for (int g = 0; g < 4; ++g) acc[g].store_unaligned(tr + c0 + g * L);
      }
      tr[r] = T(1);
    }
    return;
  }
#endif
  for (Index r = 0; r < n; ++r) {
    T* tr = t + r * ldt;
    std::fill(tr, tr + ldt, T(0));
    tr[r] = T(1);
    for (Index j = 0; j < r; ++j) {
      const T c = a[r * lda + j];
      const T* tj = t + j * ldt;
      for (Index i = 0; i <= j; ++i) tr[i] -= c * tj[i];
    }
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
