// mixattn/detail/ovq/scratch.hpp — OVQ's working memory: the dictionary loan, the block absorber
// and the forward and backward scratch kept in Saved and Grad for reuse.
//
// Internal: part of mixattn/ovq.hpp; the records hold the scratch through a Workspace.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/ovq/attention.hpp"
#include "mixattn/detail/ovq/dictionary.hpp"
#include "mixattn/ovq_types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Lends a state's dictionary storage (keys, values, counts) to a Dictionary without a copy,
/// and gives it back trimmed to the live rows (on destruction at the latest).
template <class T>
struct DictionaryLoan {
  ovq::State<T>& state;
  Dictionary<T> dict;
  bool lent = false;

  explicit DictionaryLoan(ovq::State<T>& st) : state(st) { borrow(); }
  ~DictionaryLoan() { give_back(); }
  DictionaryLoan(const DictionaryLoan&) = delete;
  DictionaryLoan& operator=(const DictionaryLoan&) = delete;

  void borrow() {
    dict.keys.swap(state.keys);
    dict.values.swap(state.values);
    dict.counts.swap(state.counts);
    dict.size = dict.keys.rows();
    lent = true;
  }
  /// Room for `capacity` rows (the live ones kept): once per call that opens centroids.
  void grow(Index capacity) {
    if (capacity <= dict.capacity()) return;
    dict.keys.conservativeResize(capacity, dict.keys.cols());
    dict.values.conservativeResize(capacity, dict.values.cols());
    dict.counts.conservativeResize(capacity);
  }
  void give_back() {
    if (!lent) return;
    if (dict.capacity() != dict.size) {
      dict.keys.conservativeResize(dict.size, dict.keys.cols());
      dict.values.conservativeResize(dict.size, dict.values.cols());
      dict.counts.conservativeResize(dict.size);
    }
    dict.keys.swap(state.keys);
    dict.values.swap(state.values);
    dict.counts.swap(state.counts);
    lent = false;
  }
};

/// The absorption of one complete block (SPEC 2.3), its scratch kept between calls.
template <class T>
class Absorber {
 public:
  void reserve(const ovq::Options& opt, Index capacity, Index key_dim, Index value_dim,
               bool own_assignment) {
    const Index c = opt.block;
    quant_.reserve(c, capacity, key_dim);
    update_.reserve(capacity, key_dim, value_dim);
    kb_.resize(c, key_dim);
    vb_.resize(c, value_dim);
    seeds_.resize(static_cast<std::size_t>(c));
    if (own_assignment) assign_.resize(static_cast<std::size_t>(c));
  }

  /// Absorbs the block [ko; kn] (unit-norm keys), [vo; vn] (values) that follows t absorbed
  /// tokens into dict (grown through `loan` when it is the state's own storage, else already of
  /// `capacity` rows); writes the tokens' centroid rows to `assign` (C entries, or internal
  /// scratch when null) and refreshes the changed log counts. Returns nu, the centroids opened.
  Index run(const ovq::Options& opt, Index t, Dictionary<T>& dict, DictionaryLoan<T>* loan,
            Index capacity, const CRef<T>& ko, const CRef<T>& vo, const CRef<T>& kn,
            const CRef<T>& vn, std::int32_t* assign, Vector<T>& logc) {
    const Index c = opt.block, po = ko.rows();
    MIXATTN_ASSERT(po + kn.rows() == c);
    kb_.topRows(po) = ko;
    kb_.bottomRows(c - po) = kn;
    vb_.topRows(po) = vo;
    vb_.bottomRows(c - po) = vn;
    const double alpha =
        opt.growth_alpha > 0 ? opt.growth_alpha : static_cast<double>(opt.max_centroids);
    const Index nu = new_centroids(t, c, dict.size, opt.max_centroids,
                                   opt.growth == ovq::Growth::plateau, alpha);
    if (dict.size + nu > dict.capacity()) {
      MIXATTN_ASSERT(loan != nullptr);
      loan->grow(capacity);
    }
    if (assign == nullptr) assign = assign_.data();
    quant_.plan(dict, kb_, nu, opt.seeding == ovq::Seeding::greedy_dispersion,
                opt.assignment == ovq::Assignment::existing_only, assign, seeds_.data());
    update_.apply(dict, kb_, vb_, assign, nu);
    for (const Index row_n : update_.touched()) logc[row_n] = std::log(dict.counts[row_n]);
    return nu;
  }
  Index seed(Index p) const { return seeds_[static_cast<std::size_t>(p)]; }

 private:
  BlockQuantizer<T> quant_;
  MeanUpdate<T> update_;
  Matrix<T> kb_, vb_;  // C x r, C x d_v: the whole block
  std::vector<std::int32_t> seeds_, assign_;
};

/// A forward call's working memory (kept in Saved for reuse; capacity kept when shapes repeat).
template <class T>
struct OvqForwardScratch {
  Dictionary<T> dict;    // the working dictionary when the end state goes to another State
  Matrix<T> kn, vn, qh;  // one block's call tokens: normalised keys, values; normalised queries
  Vector<T> logc;
  AttentionScratch<T> sc;
  Absorber<T> absorb;
};

/// A backward call's working memory (kept in Grad for reuse).
template <class T>
struct OvqBackwardScratch {
  std::vector<Dictionary<T>> checkpoints, snaps;
  Dictionary<T> work;
  MeanUpdate<T> update;
  Matrix<T> kb, vb, qh, dkb, dvb, ddk, ddv;
  Matrix<T> dpk, dpv;  // dL/d(end state's pending tokens), read before grad.state is written
  Vector<T> logc;
  AttentionScratch<T> sc;
  std::vector<Index> hits;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
