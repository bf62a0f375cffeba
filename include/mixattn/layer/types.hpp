// mixattn/layer/types.hpp — the records of layer::MultiHeadAttention (layer.hpp): what forward
// keeps for backward (Cache), the gradients (Gradients) and a sequence's decoding state
// (DecodeState). Each holds its mixer's per-item records behind the mixer interface
// (layer/mixer.hpp).
#pragma once

#include "mixattn/common_types.hpp"
#include "mixattn/core.hpp"
#include "mixattn/detail/common/parallel_gemm.hpp"
#include "mixattn/layer/mixer.hpp"
#include "mixattn/named_block.hpp"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// What forward keeps for backward: the projections, the concatenated head outputs and each
/// (sequence, head) item's record of the layer's mixer. O(N (H·(2r + 2 d_v))) plus what the
/// mixers save (O(N) per head for GMA and flash softmax; OVQ's checkpoints). Reusable across
/// calls: buffers are resized only when N changes.
template <class T>
struct Cache {
  Matrix<T> q, k, v;  ///< N x H·r, N x H·r, N x H·d_v (q and k rotated with Config::rope)
  Matrix<T> mixed;    ///< N x H·d_v, the head outputs side by side
  ::mixattn::detail::OwnedRecords saved;  ///< the mixer's records, one per item
  Index tokens = -1;                      ///< N of the forward that filled it; -1 when empty
  std::uint64_t fingerprint[2] = {0, 0};  ///< of x and of every parameter, checked by backward
  Offsets offsets;  ///< the batch's sequence offsets ({0, N} for one sequence)
  // Working memory reused by forward_into: one output per (sequence, head).
  std::vector<Matrix<T>> head_out;
  std::vector<Index> order;
  ::mixattn::detail::GemmTasks<T> gemm;  // the projections, run as tasks on the pool
};

/// Gradients of a scalar loss: x (N x d_model) and one block per parameter, params[i] matching
/// MultiHeadAttention::parameters()[i] in name and shape.
template <class T>
struct Gradients {
  Matrix<T> x;
  std::vector<std::string> names;
  std::vector<Matrix<T>> params;
  // Working memory reused by backward_into: dM, dQ, dK, dV and one gradient record per item.
  Matrix<T> d_mixed, dq, dk, dv;
  ::mixattn::detail::OwnedRecords heads;
  std::vector<Index> order;
  ::mixattn::detail::GemmTasks<T> gemm;
  /// Where each parameter's gradient is in params, found by name when the blocks are set up:
  /// w_q, w_k, w_v, w_o, then per head its mixer's blocks.
  std::size_t slot_w[4] = {0, 0, 0, 0};
  std::vector<std::array<std::size_t, ::mixattn::detail::max_head_blocks>> slot_head;
  /// The gradient named `name` (a name of parameters()); throws std::invalid_argument when there
  /// is none.
  Matrix<T>& param(const std::string& name) { return params[index_of(name)]; }
  const Matrix<T>& param(const std::string& name) const { return params[index_of(name)]; }
  std::size_t index_of(const std::string& name) const {
    for (std::size_t i = 0; i < names.size() && i < params.size(); ++i)
      if (names[i] == name) return i;
    ::mixattn::detail::raise_invalid_argument(::mixattn::detail::concat(
        "mixattn::layer::Gradients::param: no parameter named '", name, "' among ", names.size()));
    return 0;
  }
  /// Named views of params (valid while this object lives and is not resized).
  std::vector<NamedBlock<T>> blocks() {
    std::vector<NamedBlock<T>> out;
    out.reserve(params.size());
    for (std::size_t i = 0; i < params.size(); ++i)
      out.push_back({names[i], params[i].data(), params[i].rows(), params[i].cols()});
    return out;
  }
};

/// One sequence's incremental state for decoding with a causal layer (begin_decoding()): per
/// head a gma::State (with the head's mixture prepared once), an ovq::State or a softmax
/// reference::KvCache, whichever the layer's mixer needs. GMA and OVQ states have a constant
/// size; the softmax cache grows with the sequence. The mixtures are a snapshot taken by
/// begin_decoding: after changing them, begin again (decode checks each prepared mixture's
/// fingerprint against the layer's and rejects a stale state).
template <class T>
struct DecodeState {
  ::mixattn::detail::OwnedRecords heads;  ///< the mixer's per-head states
  Index tokens_seen = 0;
  const void* layer = nullptr;  // the layer that began it (decode rejects another's)
};

}  // namespace layer
MIXATTN_END_NAMESPACE
