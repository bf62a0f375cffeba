// bench/counting_allocator.hpp — replaces the process's heap entry points with counting ones.
//
// DEFINES non-inline functions: include it from exactly one translation unit per binary
// (bench_common.hpp does so unless MIXATTN_BENCH_NO_ALLOCATOR is defined).
//
// Two layers are replaced, because the library allocates through both:
//  - malloc/free/calloc/realloc/memalign/posix_memalign/aligned_alloc/valloc/pvalloc, since
//    Eigen's aligned_malloc calls std::malloc directly, never operator new;
//  - every global operator new/delete (plain, array, sized, nothrow, align_val_t), for
//    std::vector and friends. They count through the same malloc layer, so nothing counts twice.
// The replacements forward to glibc's own allocator (__libc_malloc & co., exported by glibc for
// exactly this purpose) and account sizes with malloc_usable_size, so a block's size is known on
// free without a header. glibc only: this is a Debian 12 benchmark harness.
#pragma once

#include <malloc.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#if defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
// clang's <mm_malloc.h> (pulled in by every x86 intrinsics header) redeclares posix_memalign
// without glibc's noexcept; seen after the definition below that is an error, seen before it
// (a system header's declaration) it is accepted.
#include <mm_malloc.h>
#endif

extern "C" {
void* __libc_malloc(std::size_t);
void __libc_free(void*);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
}

namespace mixattn::bench {

/// Process-wide heap accounting. `current` is bytes live now; `peak` the high-water mark since the
/// last reset_peak(); `allocs` and `total` are monotone counters of calls and bytes allocated.
struct HeapCounters {
  std::atomic<std::int64_t> current{0};
  std::atomic<std::int64_t> peak{0};
  std::atomic<std::int64_t> allocs{0};
  std::atomic<std::int64_t> total{0};
};

HeapCounters& heap_counters() noexcept {
  // Constant-initialised, so it is usable by allocations made before main and by static
  // initialisers of other objects.
  static HeapCounters counters;
  return counters;
}

namespace detail {

inline void note_alloc(void* p) noexcept {
  if (!p) return;
  const auto n = static_cast<std::int64_t>(malloc_usable_size(p));
  HeapCounters& c = heap_counters();
  c.allocs.fetch_add(1, std::memory_order_relaxed);
  c.total.fetch_add(n, std::memory_order_relaxed);
  const std::int64_t now = c.current.fetch_add(n, std::memory_order_relaxed) + n;
  std::int64_t seen = c.peak.load(std::memory_order_relaxed);
  while (now > seen && !c.peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

inline void note_free(void* p) noexcept {
  if (!p) return;
  const auto n = static_cast<std::int64_t>(malloc_usable_size(p));
  heap_counters().current.fetch_sub(n, std::memory_order_relaxed);
}

inline void* counted_memalign(std::size_t align, std::size_t size) noexcept {
  void* p = __libc_memalign(align, size);
  note_alloc(p);
  return p;
}

}  // namespace detail
}  // namespace mixattn::bench

// ---- C heap ------------------------------------------------------------------------------------
extern "C" {

void* malloc(std::size_t size) noexcept {
  void* p = __libc_malloc(size);
  mixattn::bench::detail::note_alloc(p);
  return p;
}

void free(void* p) noexcept {
  mixattn::bench::detail::note_free(p);
  __libc_free(p);
}

void* calloc(std::size_t count, std::size_t size) noexcept {
  void* p = __libc_calloc(count, size);
  mixattn::bench::detail::note_alloc(p);
  return p;
}

void* realloc(void* old, std::size_t size) noexcept {
  // Accounted as free + malloc; glibc may move the block, and a failed realloc keeps `old`.
  const auto old_size = old ? static_cast<std::int64_t>(malloc_usable_size(old)) : 0;
  void* p = __libc_realloc(old, size);
  if (p || size == 0) {
    mixattn::bench::heap_counters().current.fetch_sub(old_size, std::memory_order_relaxed);
    mixattn::bench::detail::note_alloc(p);
  }
  return p;
}

void* memalign(std::size_t align, std::size_t size) noexcept {
  return mixattn::bench::detail::counted_memalign(align, size);
}

void* aligned_alloc(std::size_t align, std::size_t size) noexcept {
  return mixattn::bench::detail::counted_memalign(align, size);
}

int posix_memalign(void** out, std::size_t align, std::size_t size) noexcept {
  if (align < sizeof(void*) || (align & (align - 1)) != 0) return EINVAL;
  void* p = mixattn::bench::detail::counted_memalign(align, size);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}

void* valloc(std::size_t size) noexcept {
  return mixattn::bench::detail::counted_memalign(4096, size);
}

void* pvalloc(std::size_t size) noexcept {
  return mixattn::bench::detail::counted_memalign(4096, (size + 4095) & ~std::size_t(4095));
}

}  // extern "C"

// ---- C++ heap ----------------------------------------------------------------------------------
namespace mixattn::bench::detail {
inline void* new_or_throw(std::size_t n) {
  if (n == 0) n = 1;
  void* p = ::malloc(n);
  if (!p) throw std::bad_alloc();
  return p;
}
inline void* aligned_new_or_throw(std::size_t n, std::align_val_t al) {
  if (n == 0) n = 1;
  void* p = counted_memalign(static_cast<std::size_t>(al), n);
  if (!p) throw std::bad_alloc();
  return p;
}
}  // namespace mixattn::bench::detail

void* operator new(std::size_t n) {
  return mixattn::bench::detail::new_or_throw(n);
}
void* operator new[](std::size_t n) {
  return mixattn::bench::detail::new_or_throw(n);
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return ::malloc(n ? n : 1);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return ::malloc(n ? n : 1);
}
void* operator new(std::size_t n, std::align_val_t al) {
  return mixattn::bench::detail::aligned_new_or_throw(n, al);
}
void* operator new[](std::size_t n, std::align_val_t al) {
  return mixattn::bench::detail::aligned_new_or_throw(n, al);
}
void* operator new(std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  return mixattn::bench::detail::counted_memalign(static_cast<std::size_t>(al), n ? n : 1);
}
void* operator new[](std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  return mixattn::bench::detail::counted_memalign(static_cast<std::size_t>(al), n ? n : 1);
}

void operator delete(void* p) noexcept {
  ::free(p);
}
void operator delete[](void* p) noexcept {
  ::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  ::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  ::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  ::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  ::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  ::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  ::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  ::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  ::free(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  ::free(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  ::free(p);
}
