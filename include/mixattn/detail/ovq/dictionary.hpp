// mixattn/detail/ovq/dictionary.hpp — the OVQ dictionary and its online k-means step (SPEC.md
// §2.3): growth schedule, dispersion seeding, nearest-centroid assignment and the exact
// running-mean update. Internal: included by mixattn/ovq.hpp, which validates every argument first.
//
// Determinism matters more than usual here: streaming (SPEC §2.5) promises the same final state
// however a sequence is split, so a block's update must be a function of the block's normalised
// keys, its values and the dictionary alone. Every routine below reads only those, always with
// the same shapes (C x r, C x d_v), so the state is bit-identical for any split, and the backward
// can replay the updates bit for bit from the recorded assignments.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/row_tiles.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Dictionary size after t absorbed tokens under the plateau schedule (SPEC 2.3 step 1):
/// N(t) = min(max(floor(t N_max / (t + alpha)), 1), N_max) for t >= 1, N(0) = 0.
/// Exact for integral alpha (128-bit integers: t N_max cannot overflow); for fractional alpha
/// the quotient is taken in long double.
inline Index plateau_size(Index t, Index n_max, double alpha) {
  if (t <= 0) return 0;
  Index n = 0;
#if defined(__SIZEOF_INT128__)
  if (alpha >= 0 && alpha < 9.0e15 && alpha == std::floor(alpha)) {
    __extension__ typedef unsigned __int128 u128;
    const u128 num = static_cast<u128>(t) * static_cast<u128>(n_max);
    const u128 den = static_cast<u128>(t) + static_cast<u128>(static_cast<std::uint64_t>(alpha));
    n = static_cast<Index>(num / den);  // <= n_max because t <= t + alpha
  } else
#endif
  {
    const long double x = static_cast<long double>(t) * static_cast<long double>(n_max) /
                          (static_cast<long double>(t) + static_cast<long double>(alpha));
    n = x >= static_cast<long double>(n_max) ? n_max : static_cast<Index>(std::floor(x));
  }
  return std::min(std::max(n, Index(1)), n_max);
}

/// Dictionary size after t absorbed tokens under the linear schedule: N(t) = min(t, N_max).
inline Index linear_size(Index t, Index n_max) {
  return t <= 0 ? 0 : std::min(t, n_max);
}

/// Centroids opened by the block that follows t absorbed tokens: nu = N(t + C) - N_t, with N_t
/// the dictionary's current size (equal to N(t) for any state this library produced, since
/// nu <= C for the default alpha), clamped to [0, C] because a block cannot seed more tokens
/// than it has. Working from the current size lets a hand-built or capped state catch up to
/// the schedule instead of overshooting N_max.
inline Index new_centroids(Index t, Index block, Index current, Index n_max, bool plateau,
                           double alpha) {
  const Index target =
      plateau ? plateau_size(t + block, n_max, alpha) : linear_size(t + block, n_max);
  return std::clamp<Index>(target - current, 0, block);
}

/// One head's dictionary in capacity-sized buffers: rows [0, size) are live, so a block's
/// update never reallocates.
template <class T>
struct Dictionary {
  Matrix<T> keys;    // capacity x r: running means of unit-norm keys
  Matrix<T> values;  // capacity x d_v: running means of the same tokens' values
  Vector<T> counts;  // capacity: tokens absorbed per centroid
  Index size = 0;

  void allocate(Index capacity, Index key_dim, Index value_dim) {
    keys.resize(capacity, key_dim);
    values.resize(capacity, value_dim);
    counts.resize(capacity);
    size = 0;
  }
  Index capacity() const { return keys.rows(); }

  /// Copies the live rows of `other` (capacity must suffice).
  void copy_from(const Dictionary& other) {
    MIXATTN_ASSERT(other.size <= capacity());
    size = other.size;
    keys.topRows(size) = other.keys.topRows(size);
    values.topRows(size) = other.values.topRows(size);
    counts.head(size) = other.counts.head(size);
  }

  template <class K, class V, class C>
  void load(const Eigen::MatrixBase<K>& k, const Eigen::MatrixBase<V>& v,
            const Eigen::MatrixBase<C>& c) {
    MIXATTN_ASSERT(k.rows() <= capacity());
    size = k.rows();
    keys.topRows(size) = k;
    values.topRows(size) = v;
    counts.head(size) = c;
  }
};

/// Index of the first x[i] == v in x[0, n), n when there is none: whole chunks are tested with a
/// branch-free (vectorisable) OR of compares, then the hit chunk is scanned.
template <class T>
Index first_equal(const T* x, Index n, T v) {
  constexpr Index chunk = 32;
  Index i = 0;
  for (; i + chunk <= n; i += chunk) {
    int hit = 0;
    for (Index j = 0; j < chunk; ++j) hit |= static_cast<int>(x[i + j] == v);
    if (hit != 0) break;
  }
  while (i < n && !(x[i] == v)) ++i;
  return i;
}

/// Dictionary rows scored per GEMM when a block looks for its nearest centroids: a C x 256
/// score tile (256 KiB in float at C = 256) stays in L2 next to the dictionary, and the packed
/// tile of keys stays under Eigen's 128 KiB stack limit, so absorbing a block neither evicts
/// the dictionary the next tokens attend to nor allocates.
constexpr Index score_tile = 256;

/// Seeding and assignment of one complete block (SPEC 2.3 steps 2-3). Scratch is sized once.
template <class T>
class BlockQuantizer {
 public:
  void reserve(Index block, Index capacity, Index key_dim) {
#if MIXATTN_HAS_SIMD
    const Index padded = padded_to_vectors<T>(block);
    kbt_.resize(key_dim, padded);
    lane_best_.resize(padded);
    lane_arg_.resize(padded);
    if (!tiled_nearest(capacity))
#endif
      scores_.resize(block, std::min(capacity, score_tile));
    seed_dots_.resize(block, block);
    seed_keys_.resize(block, key_dim);
    best_.resize(block);
    arg_.resize(block);
    key_.resize(block);
    pick_of_.resize(static_cast<std::size_t>(block));
    order_.resize(static_cast<std::size_t>(block));
  }

  /// kb: C x r unit-norm block keys; dict: the dictionary before this block; nu <= C new
  /// centroids. Writes assign[j] (the centroid row of block token j; seeds get their own new
  /// row n0 + pick) and seeds[p] (block index of the p-th pick, p < nu). existing_only: other
  /// tokens join their nearest old row, or row 0 (the first pick) when there is none.
  void plan(const Dictionary<T>& dict, const Eigen::Ref<const Matrix<T>>& kb, Index nu, bool greedy,
            bool existing_only, std::int32_t* assign, std::int32_t* seeds) {
    const Index c = kb.rows();
    MIXATTN_ASSERT(nu <= c && c <= best_.size());
#if MIXATTN_HAS_SIMD
    if (tiled_nearest(dict.size))
      nearest_old_rows_tiled(dict, kb);
    else
#endif
      nearest_old_rows(dict, kb);
    std::fill(pick_of_.begin(), pick_of_.begin() + c, -1);
    for (Index j = 0; j < c; ++j) key_[j] = best_[j];
    if (greedy)
      seed_greedy(kb, nu, seeds);
    else if (nu > 0)
      seed_one_shot(kb, nu, dict.size, existing_only, seeds);
    assign_tokens(c, nu, dict.size, existing_only, assign);
  }

  /// Whether nearest_old_rows_tiled serves a dictionary of n rows: SIMD builds, row indices
  /// exact in T's lanes.
  static constexpr bool tiled_nearest(Index n) {
    return MIXATTN_HAS_SIMD != 0 && n <= (Index(1) << std::numeric_limits<T>::digits);
  }

  /// Nearest old centroid of every token (ties -> lowest row) into best_ / arg_, reused by the
  /// seeding score and the assignment: C x N scores, one tile of dictionary rows at a time.
  /// Public, with nearest_old_rows_tiled, best() and nearest(), for the tests of the one
  /// against the other.
  void nearest_old_rows(const Dictionary<T>& dict, const Eigen::Ref<const Matrix<T>>& kb) {
    const Index c = kb.rows(), n0 = dict.size;
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    // SIMD builds size the score tile only where this path serves (reserve)
    if (scores_.rows() < c || scores_.cols() < std::min(n0, score_tile))
      scores_.resize(c, std::min(n0, score_tile));
    for (Index j = 0; j < c; ++j) {
      best_[j] = neg_inf;
      arg_[j] = 0;  // a row that exists (or the first pick's) even if every score is NaN
    }
    for (Index n_lo = 0; n_lo < n0; n_lo += score_tile) {
      const Index nt = std::min(score_tile, n0 - n_lo);
      Eigen::Ref<Matrix<T>> s = scores_.topLeftCorner(c, nt);
      s.noalias() = kb * dict.keys.middleRows(n_lo, nt).transpose();
      for (Index j = 0; j < c; ++j) {
        // Vectorised max of the tile; a strictly larger one than the earlier tiles' moves the
        // token to its first row attaining it (ties -> lowest row).
        const T best = s.row(j).maxCoeff();
        if (!(best > best_[j])) continue;
        const Index arg = first_equal(s.row(j).data(), nt, best);
        if (arg == nt) continue;  // NaN maximum: no row attains it
        best_[j] = best;
        arg_[j] = n_lo + arg;
      }
    }
  }

#if MIXATTN_HAS_SIMD
  /// nearest_old_rows on register tiles: the scores are computed transposed, D_k K_b^T, each
  /// dictionary row broadcast against vectors of the block's tokens (K_b^T, the only copy), and
  /// never stored: the epilogue keeps every token's best score and its row in vector lanes
  /// (strict >, rows in ascending order: ties -> lowest row; a NaN score never wins).
  void nearest_old_rows_tiled(const Dictionary<T>& dict, const Eigen::Ref<const Matrix<T>>& kb) {
    using Arch = simd_arch;
    using B = xsimd::batch<T, Arch>;
    constexpr Index Wd = static_cast<Index>(B::size);
    constexpr int R = plain_tile_rows<Arch>(), NV = row_tile_vectors<Arch>();
    const Index c = kb.rows(), r = kb.cols(), n0 = dict.size, cp = padded_to_vectors<T>(c);
    MIXATTN_ASSERT(kbt_.rows() >= r && kbt_.cols() >= cp && lane_best_.size() >= cp);
    T* const kt = kbt_.data();  // r x cp, stride cp
    transpose_padded<T>(kb, kt, cp);
    T* const bst = lane_best_.data();
    T* const arg = lane_arg_.data();
    for (Index j = 0; j < cp; ++j) {
      bst[j] = -std::numeric_limits<T>::infinity();
      arg[j] = T(0);
    }
    const T* const keys = dict.keys.data();
    const Index ld = dict.keys.outerStride();
    // panels of NV token vectors outer, so that their slice of K_b^T (r x NV vectors) stays in
    // L1 while the dictionary streams through
    over_column_tiles<NV, Arch, T>(cp, [&](Index c0, auto nv_c) {
      constexpr int NVp = decltype(nv_c)::value;
      for (Index x0 = 0; x0 < n0; x0 += R)
        with_rows<R>(std::min<Index>(R, n0 - x0), [&](auto rows_c) {
          constexpr int RR = decltype(rows_c)::value;
          B acc[RR][NVp];
          for (int i = 0; i < RR; ++i)
            for (int j = 0; j < NVp; ++j) acc[i][j] = B(T(0));
          read_accumulate<RR, NVp, Arch>(acc, keys + x0 * ld, ld, kt, cp, r, c0);
          for (int j = 0; j < NVp; ++j) {
            B best = B::load_unaligned(bst + c0 + j * Wd),
              at = B::load_unaligned(arg + c0 + j * Wd);
            for (int i = 0; i < RR; ++i) {
              const auto gt = acc[i][j] > best;
              best = xsimd::select(gt, acc[i][j], best);
              at = xsimd::select(gt, B(static_cast<T>(x0 + i)), at);
            }
            best.store_unaligned(bst + c0 + j * Wd);
            at.store_unaligned(arg + c0 + j * Wd);
          }
        });
    });
    for (Index j = 0; j < c; ++j) {
      best_[j] = bst[j];
      arg_[j] = static_cast<Index>(arg[j]);
    }
  }
#endif

  /// What the last nearest_old_rows(_tiled) found for token j: its best score and row.
  T best(Index j) const {
    return best_[j];
  }
  Index nearest(Index j) const {
    return arg_[j];
  }

 private:
  /// Greedy seeding: each pick is the unpicked token whose largest similarity to every centroid
  /// so far is smallest (strict < keeps the lowest index on ties; with no centroid all keys are
  /// -inf and token 0 wins, as the rule says).
  void seed_greedy(const Eigen::Ref<const Matrix<T>>& kb, Index nu, std::int32_t* seeds) {
    const Index c = kb.rows();
    for (Index p = 0; p < nu; ++p) {
      Index pick = -1;
      T low = std::numeric_limits<T>::infinity();
      for (Index j = 0; j < c; ++j)
        if (pick_of_[j] < 0 && (pick < 0 || key_[j] < low)) low = key_[j], pick = j;
      seeds[p] = static_cast<std::int32_t>(pick);
      pick_of_[pick] = p;
      seed_dots_.col(p).head(c).noalias() = kb * kb.row(pick).transpose();
      for (Index j = 0; j < c; ++j) key_[j] = std::max(key_[j], seed_dots_(j, p));
    }
  }

  /// One-shot seeding: all picks scored against the old dictionary; with none, the first token
  /// is the first pick and the others are scored against it alone.
  void seed_one_shot(const Eigen::Ref<const Matrix<T>>& kb, Index nu, Index n0, bool existing_only,
                     std::int32_t* seeds) {
    const Index c = kb.rows();
    Index p0 = 0;
    if (n0 == 0) {
      seeds[0] = 0;
      pick_of_[0] = 0;
      p0 = 1;
      for (Index j = 0; j < c; ++j) key_[j] = kb.row(j).dot(kb.row(0));
    }
    Index m = 0;
    for (Index j = 0; j < c; ++j)
      if (pick_of_[j] < 0) order_[m++] = j;
    const Index take = nu - p0;
    std::partial_sort(
        order_.begin(), order_.begin() + take, order_.begin() + m,
        [this](Index a, Index b) { return key_[a] < key_[b] || (!(key_[b] < key_[a]) && a < b); });
    for (Index p = p0; p < nu; ++p) {
      const Index pick = order_[p - p0];
      seeds[p] = static_cast<std::int32_t>(pick);
      pick_of_[pick] = p;
    }
    if (!existing_only) {
      for (Index p = 0; p < nu; ++p) seed_keys_.row(p) = kb.row(seeds[p]);
      seed_dots_.topLeftCorner(c, nu).noalias() = kb * seed_keys_.topRows(nu).transpose();
    }
  }

  /// Assignment: argmax over old rows then (unless existing_only) the new seeds in row order;
  /// strict > keeps the lowest row on ties. Seeds count as assigned to their own centroid.
  /// arg_ already holds the nearest old row, and row 0 = n0 + first pick without old rows.
  void assign_tokens(Index c, Index nu, Index n0, bool existing_only, std::int32_t* assign) const {
    const Index candidates = existing_only ? 0 : nu;
    for (Index j = 0; j < c; ++j) {
      if (pick_of_[j] >= 0) {
        assign[j] = static_cast<std::int32_t>(n0 + pick_of_[j]);
        continue;
      }
      T best = best_[j];
      Index arg = arg_[j];
      for (Index p = 0; p < candidates; ++p)
        if (seed_dots_(j, p) > best) best = seed_dots_(j, p), arg = n0 + p;
      assign[j] = static_cast<std::int32_t>(arg);
    }
  }

  Matrix<T> scores_;                                            // C x score_tile
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> seed_dots_;  // C x C: column p = kb kb[seed p]
  Matrix<T> seed_keys_;                                         // C x r (one-shot gather)
  Matrix<T> kbt_;                   // r x C' (C rounded up to whole vectors): K_b^T, tiled path
  Vector<T> lane_best_, lane_arg_;  // C': best score and its row, per token lane
  Vector<T> best_, key_;
  Eigen::Matrix<Index, Eigen::Dynamic, 1> arg_;
  std::vector<Index> pick_of_, order_;
};

/// The exact running-mean update of SPEC 2.3 step 4, in the wide type:
///   c_new = c_old + m_n,  D[n] <- (c_old D[n] + sum_{j->n} x_j) / c_new,
/// new rows (n >= size) starting from c_old = 0. Only touched rows are read or written.
template <class T>
class MeanUpdate {
 public:
  using W = wide_t<T>;

  void reserve(Index capacity, Index key_dim, Index value_dim) {
    sum_k_.resize(capacity, key_dim);
    sum_v_.resize(capacity, value_dim);
    hits_.assign(static_cast<std::size_t>(capacity), 0);
    touched_.reserve(static_cast<std::size_t>(capacity));
  }

  /// kb: C x r unit-norm keys, vb: C x d_v values, assign: C rows in [0, size + nu).
  /// Rows the last apply() wrote (their counts changed), in first-touch order.
  const std::vector<Index>& touched() const { return touched_; }

  void apply(Dictionary<T>& dict, const Eigen::Ref<const Matrix<T>>& kb,
             const Eigen::Ref<const Matrix<T>>& vb, const std::int32_t* assign, Index nu) {
    const Index c = kb.rows(), n0 = dict.size;
    MIXATTN_ASSERT(n0 + nu <= dict.capacity());
    touched_.clear();
    for (Index j = 0; j < c; ++j) {
      const Index n = assign[j];
      MIXATTN_ASSERT(n >= 0 && n < n0 + nu);
      if (hits_[n]++ == 0) {
        touched_.push_back(n);
        sum_k_.row(n).setZero();
        sum_v_.row(n).setZero();
      }
      sum_k_.row(n) += kb.row(j).template cast<W>();
      sum_v_.row(n) += vb.row(j).template cast<W>();
    }
    for (const Index n : touched_) {
      const W c_old = n < n0 ? static_cast<W>(dict.counts[n]) : W(0);
      const W c_new = c_old + static_cast<W>(hits_[n]);
      if (n < n0) {
        dict.keys.row(n) = ((c_old * dict.keys.row(n).template cast<W>() + sum_k_.row(n)) / c_new)
                               .template cast<T>();
        dict.values.row(n) =
            ((c_old * dict.values.row(n).template cast<W>() + sum_v_.row(n)) / c_new)
                .template cast<T>();
      } else {
        dict.keys.row(n) = (sum_k_.row(n) / c_new).template cast<T>();
        dict.values.row(n) = (sum_v_.row(n) / c_new).template cast<T>();
      }
      dict.counts[n] = static_cast<T>(c_new);
      hits_[n] = 0;
    }
    dict.size = n0 + nu;
  }

 private:
  Matrix<W> sum_k_, sum_v_;
  std::vector<Index> hits_;
  std::vector<Index> touched_;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
