// mixattn/mixattn.hpp — umbrella header: the whole public API.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/gma.hpp"
#include "mixattn/ovq.hpp"
#include "mixattn/reference.hpp"
#include "mixattn/linear.hpp"
#include "mixattn/performer.hpp"
#include "mixattn/vq.hpp"
#include "mixattn/rope.hpp"
#include "mixattn/parallel.hpp"
#include "mixattn/batched.hpp"
#include "mixattn/packed.hpp"
#include "mixattn/diagnostics.hpp"
#include "mixattn/layer.hpp"
#include "mixattn/adam.hpp"
