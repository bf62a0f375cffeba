// Compiled with -march=native: see probe.hpp.
#define MIXATTN_TWO_TU_BODY
#include "probe.hpp"

IsaRun run_best() {
  return run_probe();
}
