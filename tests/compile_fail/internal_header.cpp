// Must not compile: a header under mixattn/detail/ included without a public header first.
// tests/CMakeLists.txt expects detail/internal_header_check.hpp's message.
#include <mixattn/detail/ovq/forward.hpp>

int main() {
  return 0;
}
