// The library's float and double operator workers, compiled once for all the test executables
// (core.hpp: compiling the operators once); the test files declare them extern.
#define MIXATTN_INSTANTIATE_TEMPLATES
#include <mixattn/mixattn.hpp>
