// libFuzzer target: the layer's decode across begin_decoding (layer.hpp). Decodes a small layer
// (mixer GMA, OVQ, softmax with or without a window or the gated delta rule, RoPE or not, H <= 2,
// dimensions <= 6,
// check_finite on or off; now and then a bidirectional or linear-attention layer, which cannot
// decode), a sequence x (<= 24 tokens, NaN/Inf/huge/tiny/zero/duplicate rows) cut into pieces,
// and a hostile call to slip in. The oracle:
//   - begin_decoding refuses a layer that cannot decode with std::invalid_argument;
//   - every decode returns n x d_model, finite for finite x (with checks on, or moderate x), or
//     throws the documented exception: invalid_argument for x of the wrong width or no rows or a
//     state of another layer, domain_error for non-finite x (checks on); a throw for x leaves the
//     DecodeState bitwise as it was;
//   - in double, for moderate x, the pieces' outputs equal the layer's forward on the whole
//     sequence (its rows are causal), within rounding relative to the values' scale.
#include <mixattn/layer.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace layer = mixattn::layer;
namespace fz = mixattn::fuzz;

using fz::max_abs;

/// Whether two decoding states are the same as far as decoding can tell: equal tokens_seen,
/// and one more token (a fixed finite row) decoded from a copy of each gives the same bits or
/// the same refusal. The per-head states are the mixer's own records, not visible here; every
/// one of them (GMA's S and z, OVQ's dictionary and pending block, the KV cache) reaches the
/// next token's output.
template <class T>
bool same_decode_state(const layer::MultiHeadAttention<T>& model, const layer::DecodeState<T>& a,
                       const layer::DecodeState<T>& b) {
  if (a.tokens_seen != b.tokens_seen) return false;
  Matrix<T> x(1, model.w_v().rows());
  for (Index j = 0; j < x.cols(); ++j) x(0, j) = T(0.25) * T(j % 7 - 3);
  const auto next = [&](const layer::DecodeState<T>& st, Matrix<T>& y) {
    layer::DecodeState<T> copy = st;
    try {
      y = model.decode(x, copy);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  };
  Matrix<T> ya, yb;
  const bool ra = next(a, ya), rb = next(b, yb);
  return ra == rb && (!ra || fz::same_bits(ya, yb));
}

layer::Config draw_config(fz::Bytes& in) {
  layer::Config cfg;
  static constexpr layer::MixerKind kinds[] = {layer::MixerKind::gma,     layer::MixerKind::gma,
                                               layer::MixerKind::ovq,     layer::MixerKind::softmax,
                                               layer::MixerKind::softmax, layer::MixerKind::linear,
                                               layer::MixerKind::delta};
  cfg.mixer = in.pick(kinds);
  cfg.causal = cfg.mixer == layer::MixerKind::ovq || cfg.mixer == layer::MixerKind::delta ||
               in.u8() % 8 != 0;
  cfg.rope = in.flag();
  cfg.model_dim = in.range(1, 6);
  cfg.heads = in.range(1, 2);
  cfg.key_dim = cfg.rope ? 2 * in.range(1, 2) : in.range(1, 4);
  cfg.value_dim = in.range(1, 4);
  cfg.components = in.range(1, 4);
  cfg.check_finite = in.u8() % 5 != 0;
  static constexpr Index block_menu[] = {1, 2, 3, 8};
  cfg.ovq.block = in.pick(block_menu);
  cfg.ovq.max_centroids = in.range(1, 8);
  const std::uint8_t w = in.u8();
  if (cfg.causal && w % 2 == 0) cfg.softmax.window = 1 + w % 8;
  static constexpr Index chunk_menu[] = {0, 1, 3};
  cfg.gma.chunk = in.pick(chunk_menu);
  cfg.delta.chunk = cfg.gma.chunk == 0 ? 64 : cfg.gma.chunk;  // (0 is GMA's default, not delta's)
  cfg.seed = in.u8();
  return cfg;
}

/// The hostile call slipped in before piece `at` (mode % 8): 0 x of the wrong width, 1 x
/// without rows, 2 a state from another layer of the same configuration; else none.
template <class T>
void hostile_call(std::uint8_t mode, const layer::MultiHeadAttention<T>& model,
                  layer::DecodeState<T>& st, const Matrix<T>& x) {
  const layer::Config& cfg = model.config();
  const layer::DecodeState<T> before = st;
  const auto refused = [&](auto&& call) {
    fz::Expect ex;
    ex.invalid = true;
    fz::run(ex, call);
  };
  switch (mode % 8) {
    case 0: {
      const Matrix<T> wide = Matrix<T>::Zero(1, cfg.model_dim + 1);
      refused([&] { model.decode(wide, st); });
      break;
    }
    case 1: refused([&] { model.decode(x.topRows(0), st); }); break;
    case 2: {
      const layer::MultiHeadAttention<T> twin(cfg);
      const Matrix<T> one = Matrix<T>::Zero(1, cfg.model_dim);
      refused([&] { twin.decode(one, st); });
      break;
    }
    default: return;
  }
  MIXATTN_FUZZ_CHECK(same_decode_state(model, st, before),
                     "a refused decode changed the state");
}

/// Decodes x in pieces into `out`; false when a piece threw (for x: the state must be unchanged).
template <class T>
bool decode_pieces(fz::Bytes& in, const layer::MultiHeadAttention<T>& model, const Matrix<T>& x,
                   const fz::Expect& ex, Matrix<T>& out) {
  layer::DecodeState<T> st = model.begin_decoding(in.range(0, 8));
  const std::vector<Index> cuts = fz::pieces(in, x.rows(), 6);
  const std::uint8_t mode = in.u8();
  const std::size_t at = in.u8() % cuts.size();
  out.resize(x.rows(), x.cols());
  Index row0 = 0;
  for (std::size_t p = 0; p < cuts.size(); ++p) {
    if (p == at) hostile_call(mode, model, st, x);
    const Index len = cuts[p];
    if (len == 0) continue;  // decode needs N >= 1 (hostile_call tries 0)
    fz::Expect pex = ex;
    pex.flags = fz::Flags();
    const auto piece = x.middleRows(row0, len);
    for (Index i = 0; i < piece.size(); ++i)
      fz::classify<T>(static_cast<double>(piece.data()[i]), pex.flags);
    // Projections and outputs of extreme x may overflow, which decode reports as domain_error.
    pex.flags.extreme = ex.flags.extreme;
    const layer::DecodeState<T> before = st;
    Matrix<T> y;
    const fz::Outcome o = fz::run(pex, [&] { y = model.decode(piece, st); });
    if (o != fz::Outcome::returned) {
      // Non-finite x (checks on) is reported before any head's state moves; an overflow
      // further on may leave it changed (documented: begin again).
      if (pex.flags.non_finite)
        MIXATTN_FUZZ_CHECK(same_decode_state(model, st, before), "a refused x changed the state");
      return false;
    }
    fz::check_result(y, len, x.cols(), pex.must_be_finite(), "decode output");
    MIXATTN_FUZZ_CHECK(st.tokens_seen == before.tokens_seen + len, "tokens_seen not advanced");
    out.middleRows(row0, len) = y;
    row0 += len;
  }
  return true;
}

template <class T>
void run_case(fz::Bytes& in) {
  const layer::Config cfg = draw_config(in);
  const layer::MultiHeadAttention<T> model(cfg);
  const bool decodes = cfg.causal && cfg.mixer != layer::MixerKind::linear;
  fz::Expect bex;
  bex.invalid = !decodes;
  layer::DecodeState<T> probe;
  if (fz::run(bex, [&] { probe = model.begin_decoding(); }) != fz::Outcome::returned) return;
  const Index n = in.range(1, 24);
  fz::Expect ex;
  ex.check_finite = cfg.check_finite;
  const Matrix<T> x = fz::matrix<T>(in, n, cfg.model_dim, ex.flags);
  // |x| beyond 1e4 (float) or 1e100 (double): products through three weight matrices and the
  // mixers' own exponentials may overflow, reported as domain_error (checks on).
  if (ex.flags.max_abs > (sizeof(T) == 4 ? 1e4 : 1e100)) ex.flags.extreme = true;
  if (fz::verbose())
    std::cerr << "mixer=" << layer::mixer_name(cfg.mixer) << " rope=" << cfg.rope
              << " d=" << cfg.model_dim << " H=" << cfg.heads << " r=" << cfg.key_dim
              << " dv=" << cfg.value_dim << " window=" << cfg.softmax.window << " n=" << n
              << " check_finite=" << cfg.check_finite << "\nx=\n" << x << "\n";
  Matrix<T> decoded;
  if (!decode_pieces(in, model, x, ex, decoded)) return;
  if (!std::is_same<T, double>::value || !ex.must_be_finite() || ex.flags.max_abs > 10) return;
  const Matrix<T> full = model.forward(x);
  // The head outputs are convex combinations of value rows (|x W_V|), rounded relative to them,
  // and reach y through W_O: the scale of an output entry is max |x W_V| times W_O's largest
  // column sum. The pieces change only rounding (chunk ends, OVQ's streaming, cache order).
  const Matrix<T> v = x * model.w_v();
  const double scale = max_abs(v) * model.w_o().cwiseAbs().colwise().sum().maxCoeff() + 1e-300;
  MIXATTN_FUZZ_CHECK(max_abs(decoded - full) <= 1e-9 * scale,
                     "decoded pieces differ from the layer's forward");
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
