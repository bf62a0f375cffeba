// mixattn/detail/common/simd.hpp — the SIMD shim: which instruction set the kernels are built for.
//
// Every SIMD kernel is a template on (Arch, T) over xsimd::batch<T, Arch> with a scalar tail, and
// the public entry points carry `Arch = detail::simd_arch` as a defaulted template parameter.
//
// Translation units built for different instruction sets (-march flags) in one program:
// - mixattn's own code is safe: all of it sits in an inline namespace named after the TU's ISA
//   (MIXATTN_ARCH_NAMESPACE, core.hpp), so each TU gets its own symbols and runs the kernels it was
//   compiled for; tests/two_tu links an x86-64-v2 TU and a -march=native TU and compares them.
// - Eigen's code is not ours to tag. Its template instantiations and inline functions (matrix
//   products, the aligned allocator, ...) have the same symbol in every TU, and the linker keeps
//   one copy of each, from whichever TU it picks. So (a) every TU must define the same
//   EIGEN_MAX_ALIGN_BYTES and EIGEN_MAX_STATIC_ALIGN_BYTES (their defaults follow the ISA, 16 for
//   SSE to 64 for AVX-512; Eigen's allocator and deallocator then disagree and free() crashes:
//   Eigen treats these as ABI settings), and (b) a TU built for the lower ISA may run Eigen code
//   built for the higher one, so the program is safe only on a CPU that supports every ISA linked
//   in. EIGEN_DONT_VECTORIZE does not lift (b): the compiler still auto-vectorises Eigen's scalar
//   loops for the TU's -march. Runtime dispatch (one binary that picks an AVX-512 TU only on CPUs
//   that have it) is therefore not supported by mixing TUs.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include <xsimd/xsimd.hpp>

#include <cstddef>
#include <type_traits>
#include <utility>

#include "mixattn/core.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Tag for builds where xsimd has no instruction set at all: kernels fall back to scalar code.
struct scalar_arch {
  static constexpr const char* name() noexcept { return "scalar"; }
};

#if defined(XSIMD_NO_SUPPORTED_ARCHITECTURE)
#define MIXATTN_HAS_SIMD 0
using simd_arch = scalar_arch;
#else
#define MIXATTN_HAS_SIMD 1
/// The best instruction set this translation unit is compiled for.
using simd_arch = xsimd::default_arch;
#endif

/// f(std::integral_constant<int, rows>) for a run-time rows in [1, R]: a tile's count of rows
/// (or registers) made a compile-time one.
template <int R, class F>
inline void with_rows(Index rows, F&& f) {
  if constexpr (R > 1)
    if (rows < R) return with_rows<R - 1>(rows, std::forward<F>(f));
  f(std::integral_constant<int, R>{});
}

/// Lanes of one register of T for Arch (1 for the scalar fallback).
template <class Arch, class T, class = void>
struct simd_width : std::integral_constant<std::size_t, 1> {};
#if MIXATTN_HAS_SIMD
template <class Arch, class T>
struct simd_width<Arch, T, std::enable_if_t<!std::is_same<Arch, scalar_arch>::value>>
    : std::integral_constant<std::size_t, xsimd::batch<T, Arch>::size> {};
#endif

/// Architectural vector registers available to a register-blocked kernel (x86-64: 32 with
/// AVX-512, 16 otherwise; NEON has 32).
template <class Arch>
constexpr int simd_registers() {
#if MIXATTN_HAS_SIMD && XSIMD_WITH_AVX512F
  if (std::is_base_of<xsimd::avx512f, Arch>::value) return 32;
#endif
#if MIXATTN_HAS_SIMD && (XSIMD_WITH_NEON || XSIMD_WITH_NEON64)
  if (std::is_base_of<xsimd::neon, Arch>::value) return 32;
#endif
  return 16;
}

/// While alive, this thread's SSE/AVX arithmetic flushes subnormal results to zero and reads
/// subnormal operands as zero (MXCSR FTZ and DAZ); the caller's mode is restored on exit,
/// exceptions included. Every FMA that meets a subnormal otherwise takes a microcode assist of
/// some hundred cycles: products of two small responsibilities (1e-20 x 1e-20) fall below float's
/// smallest normal number (1.2e-38) all the time, and such terms are far below the rounding of
/// the sums they enter (each sum also holds terms of order 1, or eps). No effect elsewhere.
class FlushSubnormals {
 public:
#if defined(__SSE2__) || defined(_M_X64)
  FlushSubnormals() : saved_(_mm_getcsr()) {
    _mm_setcsr(saved_ | 0x8040u);
  }
  ~FlushSubnormals() {
    _mm_setcsr(saved_);
  }

 private:
  unsigned saved_;
#else
  FlushSubnormals() = default;
#endif
 public:
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
