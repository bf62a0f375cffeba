// The benchmarks' counting allocator for tests that count heap allocations, replacing the
// process's malloc and operator new; under the sanitizers (whose runtimes own malloc) it is left
// out and MIXATTN_TEST_SANITIZED is defined, so those tests skip their counts. Include it first:
// the replacement must be the only definition in the program.
#pragma once

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define MIXATTN_TEST_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MIXATTN_TEST_SANITIZED 1
#endif

#ifndef MIXATTN_TEST_SANITIZED
#include "../bench/counting_allocator.hpp"
#endif
