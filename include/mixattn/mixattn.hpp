// mixattn/mixattn.hpp — umbrella header: the whole public API.
#pragma once

#include "mixattn/adam.hpp"
#include "mixattn/batched.hpp"
#include "mixattn/core.hpp"
#include "mixattn/diagnostics.hpp"
#include "mixattn/gma.hpp"
#include "mixattn/layer.hpp"
#include "mixattn/linear.hpp"
#include "mixattn/named_block.hpp"
#include "mixattn/ovq.hpp"
#include "mixattn/packed.hpp"
#include "mixattn/parallel.hpp"
#include "mixattn/performer.hpp"
#include "mixattn/reference.hpp"
#include "mixattn/rope.hpp"
#include "mixattn/vq.hpp"
#include "mixattn/window.hpp"
