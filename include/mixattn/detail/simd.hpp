// mixattn/detail/simd.hpp — the SIMD shim: which instruction set the kernels are built for.
//
// Every SIMD kernel is a template on (Arch, T) over xsimd::batch<T, Arch> with a scalar tail, and
// the public entry points carry `Arch = detail::simd_arch` as a defaulted template parameter. The
// arch is therefore part of every mangled name: two translation units compiled with different
// -m flags instantiate different symbols and can be linked together (no ODR collision, no AVX-512
// code reached from a TU that was built for SSE2).
#pragma once

#include <xsimd/xsimd.hpp>

#include <cstddef>
#include <type_traits>

namespace mixattn::detail {

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

}  // namespace mixattn::detail
