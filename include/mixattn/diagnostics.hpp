// mixattn/diagnostics.hpp — what a trained Gaussian-mixture router does (SPEC 1.7).
//
// Everything here reads a responsibility matrix Γ (N x K, rows are tokens, each row on the
// simplex: what gma::responsibilities returns) and summarises it: how much each component is
// used, how many components carry traffic, how evenly, which component each token goes to, how
// well those hard assignments line up with known token categories (NMI), and, for pictures, the
// implicit N x M affinity Γ_Q Γ_Kᵀ that GMA never forms itself.
//
// All functions are pure, allocate only their result (and O(N) scratch for NMI), and are safe
// to call from several threads at once.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/diagnostics/checks.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace diagnostics {

/// Mean usage p̄_k = (1/N) Σ_i γ_ik (SPEC 1.7). gamma: N x K responsibilities. Returns K.
/// Summed in a wide type so that float input over long sequences does not drift.
template <class T, detail::enable_if_supported<T> = 0>
Vector<T> mean_usage(const ConstMatrixArg<T>& gamma) {
  constexpr const char* fn = "mixattn::diagnostics::mean_usage";
  detail::check_responsibilities<T>(gamma, fn, "gamma");
  using W = detail::wide_t<T>;
  const Index n = gamma.rows(), k = gamma.cols();
  Vector<W> sum = Vector<W>::Zero(k);
  for (Index i = 0; i < n; ++i) sum += gamma.row(i).transpose().template cast<W>();
  return (sum / static_cast<W>(n)).template cast<T>();
}

/// Number of components whose mean usage exceeds tau (SPEC 1.7). gamma: N x K.
/// tau < 0 (the default) means the SPEC default 1/(10 K): a component used ten times less than
/// a uniform share is considered idle.
template <class T, detail::enable_if_supported<T> = 0>
Index components_used(const ConstMatrixArg<T>& gamma, double tau = -1) {
  constexpr const char* fn = "mixattn::diagnostics::components_used";
  detail::require(std::isfinite(tau) && tau < 1, fn, "tau must be finite and < 1 (",
                  "negative selects 1/(10K)), got ", tau);
  detail::check_responsibilities<T>(gamma, fn, "gamma");
  const Vector<T> usage = mean_usage<T>(gamma);
  const double threshold = tau < 0 ? 1.0 / (10.0 * static_cast<double>(gamma.cols())) : tau;
  Index used = 0;
  for (Index k = 0; k < usage.size(); ++k) used += static_cast<double>(usage[k]) > threshold;
  return used;
}

/// Normalised usage entropy H(p̄) / log K in [0, 1] (SPEC 1.7). gamma: N x K.
/// 0: every token goes to one component; 1: all components are used equally. K = 1 is defined
/// as 0 (a single component is maximally concentrated, and log 1 = 0 would divide by zero).
/// p̄ is renormalised by its sum, so rows that are off the simplex by rounding do not matter.
template <class T, detail::enable_if_supported<T> = 0>
T usage_entropy(const ConstMatrixArg<T>& gamma) {
  constexpr const char* fn = "mixattn::diagnostics::usage_entropy";
  detail::check_responsibilities<T>(gamma, fn, "gamma");
  const Index k = gamma.cols();
  if (k == 1) return T(0);
  const Vector<T> usage = mean_usage<T>(gamma);
  double total = 0;
  for (Index j = 0; j < k; ++j) total += static_cast<double>(usage[j]);
  detail::require(total > 0, fn, "gamma has all-zero rows; responsibilities lie on ",
                  "the simplex");
  double h = 0;
  for (Index j = 0; j < k; ++j) {
    const double p = static_cast<double>(usage[j]) / total;
    if (p > 0) h -= p * std::log(p);
  }
  return static_cast<T>(h / std::log(static_cast<double>(k)));
}

/// Hard assignment argmax_k γ_ik of every token (SPEC 1.7); ties go to the lowest k.
/// gamma: N x K. Returns N component indices in [0, K).
template <class T, detail::enable_if_supported<T> = 0>
std::vector<Index> hard_assignments(const ConstMatrixArg<T>& gamma) {
  constexpr const char* fn = "mixattn::diagnostics::hard_assignments";
  detail::check_responsibilities<T>(gamma, fn, "gamma");
  std::vector<Index> out(static_cast<std::size_t>(gamma.rows()));
  for (Index i = 0; i < gamma.rows(); ++i) {
    Index best = 0;
    for (Index k = 1; k < gamma.cols(); ++k)
      if (gamma(i, k) > gamma(i, best)) best = k;  // strict: a tie keeps the lower index
    out[static_cast<std::size_t>(i)] = best;
  }
  return out;
}

/// Normalised mutual information between two labelings of the same N items (SPEC 1.7),
/// arithmetic-mean normalisation:  NMI = I(A; B) / ((H(A) + H(B)) / 2)  in [0, 1].
/// Labels are arbitrary integers (only equality matters, so NMI is invariant to relabeling).
///
/// Degenerate cases. When both labelings are constant, H(A) = H(B) = I = 0 and the ratio is
/// 0/0; we return 1 because the two labelings are then the same partition (one block), and
/// identical partitions score 1 everywhere else — the convention scikit-learn also uses.
/// When exactly one is constant, I = 0 < denominator and the ratio is 0, with no special case.
template <class LabelA, class LabelB>
double normalized_mutual_information(const std::vector<LabelA>& a, const std::vector<LabelB>& b) {
  static_assert(std::is_integral<LabelA>::value && std::is_integral<LabelB>::value,
                "mixattn::diagnostics::normalized_mutual_information: labels must be integers");
  constexpr const char* fn = "mixattn::diagnostics::normalized_mutual_information";
  detail::require(a.size() == b.size(), fn, "a has ", a.size(), " labels but b has ", b.size());
  detail::require(!a.empty(), fn, "a and b are empty");
  std::vector<Index> ca, cb;
  const Index la = detail::compact_labels(a, ca);
  const Index lb = detail::compact_labels(b, cb);
  if (la == 1 && lb == 1) return 1.0;

  const std::size_t n = a.size();
  const double nd = static_cast<double>(n);
  std::vector<std::int64_t> count_a(static_cast<std::size_t>(la), 0);
  std::vector<std::int64_t> count_b(static_cast<std::size_t>(lb), 0);
  std::vector<std::int64_t> joint(static_cast<std::size_t>(la * lb), 0);
  for (std::size_t i = 0; i < n; ++i) {
    ++count_a[static_cast<std::size_t>(ca[i])];
    ++count_b[static_cast<std::size_t>(cb[i])];
    ++joint[static_cast<std::size_t>(ca[i] * lb + cb[i])];
  }
  const double ha = detail::entropy_of_counts(count_a, nd);
  const double hb = detail::entropy_of_counts(count_b, nd);
  // I = Σ_ab p_ab log(p_ab / (p_a p_b)) = Σ_ab (n_ab/N) log(N n_ab / (n_a n_b)).
  double mi = 0;
  for (Index x = 0; x < la; ++x)
    for (Index y = 0; y < lb; ++y) {
      const std::int64_t nab = joint[static_cast<std::size_t>(x * lb + y)];
      if (nab == 0) continue;
      const double na = static_cast<double>(count_a[static_cast<std::size_t>(x)]);
      const double nb = static_cast<double>(count_b[static_cast<std::size_t>(y)]);
      mi += static_cast<double>(nab) / nd * std::log(nd * static_cast<double>(nab) / (na * nb));
    }
  // I >= 0 and I <= min(H(A), H(B)) exactly; rounding can step a few ulps outside.
  const double nmi = mi / (0.5 * (ha + hb));
  return std::min(1.0, std::max(0.0, nmi));
}

/// NMI between the hard assignments of gamma (N x K) and N integer token labels (SPEC 1.7).
template <class T, class Label, detail::enable_if_supported<T> = 0>
double assignment_nmi(const ConstMatrixArg<T>& gamma, const std::vector<Label>& labels) {
  constexpr const char* fn = "mixattn::diagnostics::assignment_nmi";
  detail::require(static_cast<std::size_t>(gamma.rows()) == labels.size(), fn, "gamma has ",
                  gamma.rows(), " rows but labels has ", labels.size(), " entries");
  return normalized_mutual_information(hard_assignments<T>(gamma), labels);
}

/// Largest N·M the affinity functions accept by default: 2^24 entries (64 MiB in float). The
/// affinity is for pictures of short sequences; GMA itself never forms it (SPEC 1.3).
inline constexpr Index default_affinity_limit = Index(1) << 24;

/// The implicit affinity Ã = Γ_Q Γ_Kᵀ (SPEC 1.3, 1.7). gamma_q: N x K, gamma_k: M x K.
/// Returns N x M. Throws std::invalid_argument when N·M exceeds max_entries.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> affinity(const ConstMatrixArg<T>& gamma_q, const ConstMatrixArg<T>& gamma_k,
                   Index max_entries = default_affinity_limit) {
  constexpr const char* fn = "mixattn::diagnostics::affinity";
  detail::check_responsibilities<T>(gamma_q, fn, "gamma_q");
  detail::check_responsibilities<T>(gamma_k, fn, "gamma_k");
  detail::require(gamma_q.cols() == gamma_k.cols(), fn, "gamma_q is ", detail::shape_str(gamma_q),
                  " but gamma_k is ", detail::shape_str(gamma_k), " (the component counts differ)");
  // Division instead of N*M so that the check itself cannot overflow.
  detail::require(gamma_q.rows() <= max_entries / gamma_k.rows(), fn, "an ", gamma_q.rows(), " x ",
                  gamma_k.rows(), " affinity exceeds the limit of ", max_entries,
                  " entries (it is meant for short sequences)");
  Matrix<T> out(gamma_q.rows(), gamma_k.rows());
  out.noalias() = gamma_q * gamma_k.transpose();
  return out;
}

/// The attention weights GMA applies implicitly (SPEC 1.3, 1.4): row i of
/// diag(d)⁻¹ (mask ∘ Γ_Q Γ_Kᵀ) with d = rowsum(mask ∘ Γ_Q Γ_Kᵀ) + eps, mask inclusive-causal when
/// `causal` (then N must equal M). gamma_q: N x K, gamma_k: M x K. Returns N x M; O = result · V
/// up to the eps floor. Same size limit as affinity().
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> attention_weights(const ConstMatrixArg<T>& gamma_q, const ConstMatrixArg<T>& gamma_k,
                            bool causal, double eps = 1e-6,
                            Index max_entries = default_affinity_limit) {
  constexpr const char* fn = "mixattn::diagnostics::attention_weights";
  detail::require(!causal || gamma_q.rows() == gamma_k.rows(), fn,
                  "causal weights need as many queries as keys, got gamma_q ",
                  detail::shape_str(gamma_q), " and gamma_k ", detail::shape_str(gamma_k));
  detail::require(std::isfinite(eps) && eps >= 0, fn, "eps must be finite and >= 0, got ", eps);
  Matrix<T> a = affinity<T>(gamma_q, gamma_k, max_entries);
  for (Index i = 0; i < a.rows(); ++i) {
    if (causal) a.row(i).tail(a.cols() - i - 1).setZero();
    using W = detail::wide_t<T>;
    const W d = a.row(i).template cast<W>().sum() + static_cast<W>(eps);
    a.row(i) /= static_cast<T>(d);
  }
  return a;
}

// Deduced calls: mean_usage(gamma) with a plain matrix takes T from it (the forms above take it
// written, mean_usage<float>(gamma)). The arguments then bind to their ConstMatrixArg<T>
// parameters above, which refuse what they would copy.
template <class G, detail::enable_if_deduced<G> = 0>
Vector<typename G::Scalar> mean_usage(const G& gamma) {
  return mean_usage<typename G::Scalar>(gamma);
}
template <class G, detail::enable_if_deduced<G> = 0>
Index components_used(const G& gamma, double tau = -1) {
  return components_used<typename G::Scalar>(gamma, tau);
}
template <class G, detail::enable_if_deduced<G> = 0>
typename G::Scalar usage_entropy(const G& gamma) {
  return usage_entropy<typename G::Scalar>(gamma);
}
template <class G, detail::enable_if_deduced<G> = 0>
std::vector<Index> hard_assignments(const G& gamma) {
  return hard_assignments<typename G::Scalar>(gamma);
}
template <class G, class Label, detail::enable_if_deduced<G> = 0>
double assignment_nmi(const G& gamma, const std::vector<Label>& labels) {
  return assignment_nmi<typename G::Scalar>(gamma, labels);
}
template <class GQ, class GK, detail::enable_if_deduced<GQ, GK> = 0>
Matrix<typename GQ::Scalar> affinity(const GQ& gamma_q, const GK& gamma_k,
                                     Index max_entries = default_affinity_limit) {
  return affinity<typename GQ::Scalar>(gamma_q, gamma_k, max_entries);
}
template <class GQ, class GK, detail::enable_if_deduced<GQ, GK> = 0>
Matrix<typename GQ::Scalar> attention_weights(const GQ& gamma_q, const GK& gamma_k, bool causal,
                                              double eps = 1e-6,
                                              Index max_entries = default_affinity_limit) {
  return attention_weights<typename GQ::Scalar>(gamma_q, gamma_k, causal, eps, max_entries);
}

}  // namespace diagnostics
MIXATTN_END_NAMESPACE
