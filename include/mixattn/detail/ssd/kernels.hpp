// mixattn/detail/ssd/kernels.hpp — the SSD layer's decoding kernel (SPEC.md §10.1): one token of
// the recurrence on the wide state in one pass over it, h_s = a h_s + b_s u and y += c_s h_s,
// register-tiled: a strip of the state's columns keeps u and y in registers while the rows stream
// through, so each entry of h is loaded and stored once per token.
//
// Internal: included by mixattn/ssd.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/simd.hpp"

#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

#if MIXATTN_HAS_SIMD
/// Columns [j0, j0 + NR L) of the state, every row: dst_i = a src_i + b_i u, y = sum_i c_i dst_i;
/// returns the sum of dst * 0 (0 when every new entry is finite, NaN otherwise).
template <class Arch, class W, int NR>
MIXATTN_ALWAYS_INLINE W ssd_state_strip(const W* src, W* dst, Index S, Index P, Index j0, W a,
                                        const W* b, const W* c, const W* u, W* y) {
  using B = xsimd::batch<W, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B uv[NR], acc[NR], probe(W(0));
  const B av(a), zero(W(0));
  for (int r = 0; r < NR; ++r) {
    uv[r] = B::load_unaligned(u + j0 + r * L);
    acc[r] = B(W(0));
  }
  for (Index i = 0; i < S; ++i) {
    const B bi(b[i]), ci(c[i]);
    for (int r = 0; r < NR; ++r) {
      const B x = xsimd::fma(bi, uv[r], av * B::load_unaligned(src + i * P + j0 + r * L));
      x.store_unaligned(dst + i * P + j0 + r * L);
      acc[r] = xsimd::fma(ci, x, acc[r]);
      probe = xsimd::fma(x, zero, probe);
    }
  }
  for (int r = 0; r < NR; ++r) acc[r].store_unaligned(y + j0 + r * L);
  return xsimd::hadd(probe);
}
#endif

/// One token of (10.1) on a state of S rows and P columns (row-major, contiguous): dst = a src +
/// b u^T (dst may be src) and y = dst^T c, with b, c (S) and u, y (P) in the wide type W. Returns
/// the sum of dst * 0: 0 when the new state is finite (its check without another pass).
template <class W>
W ssd_state_pass(const W* src, W* dst, Index S, Index P, W a, const W* b, const W* c, const W* u,
                 W* y) {
  Index j0 = 0;
  W probe = 0;
#if MIXATTN_HAS_SIMD
  using Arch = simd_arch;
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    constexpr Index L = static_cast<Index>(simd_width<Arch, W>::value);
    constexpr int NR = simd_registers<Arch>() >= 32 ? 8 : 4;  // u and y: 2 NR registers
    for (; j0 + NR * L <= P; j0 += NR * L)
      probe += ssd_state_strip<Arch, W, NR>(src, dst, S, P, j0, a, b, c, u, y);
    for (; j0 + L <= P; j0 += L)
      probe += ssd_state_strip<Arch, W, 1>(src, dst, S, P, j0, a, b, c, u, y);
  }
#endif
  for (Index j = j0; j < P; ++j) y[j] = W(0);
  for (Index i = 0; i < S; ++i)
    for (Index j = j0; j < P; ++j) {
      dst[i * P + j] = a * src[i * P + j] + b[i] * u[j];
      y[j] += c[i] * dst[i * P + j];
      probe += dst[i * P + j] * W(0);
    }
  return probe;
}

}  // namespace detail
MIXATTN_END_NAMESPACE
