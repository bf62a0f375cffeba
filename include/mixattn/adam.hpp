// mixattn/adam.hpp — Adam / AdamW over a flat list of named parameter blocks (named_block.hpp).
//
//     m ← β1 m + (1 − β1) g          v ← β2 v + (1 − β2) g²
//     p ← p − lr · ( m̂ / (√v̂ + ε) + λ p ),   m̂ = m / (1 − β1ᵗ), v̂ = v / (1 − β2ᵗ)
//
// (Kingma & Ba 2015; decoupled weight decay λ as in Loshchilov & Hutter 2019.) Optional global
// gradient-norm clipping rescales all gradients together before the update.
// Not thread-safe: one optimiser, one thread.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/named_block.hpp"

#include <cmath>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace optim {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;  ///< decoupled (AdamW); 0 = plain Adam
  double clip_norm = 0;     ///< clip the global gradient L2 norm to this; 0 = off
};

/// Adam over the blocks given at construction; the blocks must outlive the optimiser.
template <class T>
class Adam {
 public:
  Adam(std::vector<layer::NamedBlock<T>> params, const AdamOptions& opt = {})
      : params_(std::move(params)), opt_(opt) {
    constexpr const char* fn = "mixattn::optim::Adam";
    detail::require(opt.lr > 0 && opt.beta1 >= 0 && opt.beta1 < 1 && opt.beta2 >= 0 &&
                        opt.beta2 < 1 && opt.eps > 0 && opt.weight_decay >= 0 && opt.clip_norm >= 0,
                    fn, "options out of range (lr > 0, 0 <= beta < 1, eps > 0, ",
                    "weight_decay >= 0, clip_norm >= 0)");
    for (const layer::NamedBlock<T>& p : params_) {
      m_.push_back(Matrix<T>::Zero(p.rows, p.cols));
      v_.push_back(Matrix<T>::Zero(p.rows, p.cols));
    }
  }

  AdamOptions& options() { return opt_; }
  long steps() const { return t_; }

  /// One update. grads[i] must have the name and shape of the i-th parameter.
  /// Returns the global gradient norm before clipping (useful to log).
  double step(const std::vector<layer::NamedBlock<T>>& grads) {
    constexpr const char* fn = "mixattn::optim::Adam::step";
    detail::require(grads.size() == params_.size(), fn, "got ", grads.size(), " gradients for ",
                    params_.size(), " parameters");
    double sq = 0;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      const layer::NamedBlock<T>& g = grads[i];
      const layer::NamedBlock<T>& p = params_[i];
      detail::require(g.name == p.name && g.rows == p.rows && g.cols == p.cols, fn, "gradient ", i,
                      " is '", g.name, "' ", g.rows, " x ", g.cols, " but parameter ", i, " is '",
                      p.name, "' ", p.rows, " x ", p.cols);
      sq += g.map().template cast<double>().squaredNorm();
    }
    const double norm = std::sqrt(sq);
    const T scale =
        static_cast<T>(opt_.clip_norm > 0 && norm > opt_.clip_norm ? opt_.clip_norm / norm : 1.0);
    ++t_;
    const T b1 = static_cast<T>(opt_.beta1), b2 = static_cast<T>(opt_.beta2);
    const T c1 = static_cast<T>(1 - std::pow(opt_.beta1, static_cast<double>(t_)));
    const T c2 = static_cast<T>(1 - std::pow(opt_.beta2, static_cast<double>(t_)));
    const T lr = static_cast<T>(opt_.lr), eps = static_cast<T>(opt_.eps);
    const T wd = static_cast<T>(opt_.weight_decay);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Eigen::Map<Matrix<T>> p = params_[i].map();
      const Eigen::Map<Matrix<T>> g = grads[i].map();
      m_[i] = b1 * m_[i] + (1 - b1) * scale * g;
      v_[i] = b2 * v_[i] + (1 - b2) * (scale * g).cwiseAbs2();
      p.array() -=
          lr * ((m_[i].array() / c1) / ((v_[i].array() / c2).sqrt() + eps) + wd * p.array());
    }
    return norm;
  }

 private:
  std::vector<layer::NamedBlock<T>> params_;
  AdamOptions opt_;
  std::vector<Matrix<T>> m_, v_;
  long t_ = 0;
};

}  // namespace optim
MIXATTN_END_NAMESPACE
