// Compiled with -march=x86-64-v2 (SSE4.2): see probe.hpp.
#define MIXATTN_TWO_TU_BODY
#include "probe.hpp"

IsaRun run_baseline() {
  return run_probe();
}
