"""The registered operators' Python halves: fake (meta) implementations, so that FakeTensor,
torch.compile and AOTAutograd know each output's shape without running a kernel, and autograd
formulas (torch.library.register_autograd) that call the backward operators.

The operators themselves (schemas and CPU kernels) are registered by the extension (python/csrc/
ops.cpp, caches.cpp) when mixattn._C is imported. Each forward returns, beside its outputs, its
record for the backward: a handle, an empty uint8 tensor whose storage owns the kernels' record
(so it lives as long as autograd keeps it, and every handle compares equal to every other);
OVQ's final state and a decoding cache are handles too. The backward operators are first-order
only: differentiating one raises (except RoPE's, whose derivative is the rotation itself).
"""

import torch

from . import _C  # noqa: F401  (registers torch.ops.mixattn.*)

ops = torch.ops.mixattn


def _handle(like):
    return like.new_empty(48, dtype=torch.uint8)  # python/csrc/bindings.hpp, kHandleBytes


def _like(*tensors):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)


def _streams(q, cu_seqlens):
    """Streams of a state or cache call: the batch, or the packed sequences."""
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


_FUNCTIONS = {"gma": "mixattn.gma_attention", "ovq": "mixattn.ovq_attention",
              "flash": "mixattn.flash_attention", "linear": "mixattn.linear_attention",
              "performer": "mixattn.performer_attention", "vq": "mixattn.vq_attention",
              "window": "mixattn.sliding_window_attention", "rope": "mixattn.rope",
              "delta": "mixattn.gated_delta_rule"}


def _same_device(op, q, tensors):
    """The kernels are CPU-only: a fake (meta) call mixing devices is refused as the kernel would
    refuse it, naming the argument, instead of returning meta outputs."""
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        name, device = next((n, d) for n, d in devices.items() if d.type != "cpu")
        raise ValueError(f"{_FUNCTIONS[op.split('_')[0]]}: {name} must be a dense CPU tensor, "
                         f"got a {device} tensor")


# --- fake implementations ------------------------------------------------------------------------

@torch.library.register_fake("mixattn::gma_forward")
def _gma_forward_fake(q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor,
                      check_finite, save, cu_seqlens=None):
    _same_device("gma_forward", q, dict(locals()))
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3]), _handle(q)


@torch.library.register_fake("mixattn::gma_backward")
def _gma_backward_fake(q, k, v, mean, var_raw, prior_logit, grad_out, saved, causal, eps,
                       var_floor, check_finite, cu_seqlens=None):
    _same_device("gma_backward", q, dict(locals()))
    return _like(q, k, v, mean, var_raw, prior_logit)


@torch.library.register_fake("mixattn::gma_forward_state")
def _gma_forward_state_fake(q, k, v, mean, var_raw, prior_logit, S0, z0, eps, var_floor,
                            check_finite, save, cu_seqlens=None, prepared=None):
    _same_device("gma_forward_state", q, dict(locals()))
    out = q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    return out, *_like(S0, z0), _handle(q)


@torch.library.register_fake("mixattn::gma_backward_state")
def _gma_backward_state_fake(q, k, v, mean, var_raw, prior_logit, S0, z0, grad_out, grad_S,
                             grad_z, saved, eps, var_floor, check_finite, cu_seqlens=None):
    _same_device("gma_backward_state", q, dict(locals()))
    return _like(q, k, v, mean, var_raw, prior_logit, S0, z0)


@torch.library.register_fake("mixattn::gma_forward_cached")
def _gma_forward_cached_fake(q, k, v, mean, var_raw, prior_logit, cache, eps, var_floor,
                             check_finite, save, cu_seqlens=None):
    _same_device("gma_forward_cached", q, dict(locals()))
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3]), _handle(q)


@torch.library.register_fake("mixattn::ovq_forward")
def _ovq_forward_fake(q, k, v, beta, block, max_centroids, growth, growth_alpha, seeding,
                      assignment, count_bias, grad_through_dictionary, norm_eps, check_finite,
                      save, initial_state=None, cu_seqlens=None):
    _same_device("ovq_forward", q, dict(locals()))
    out = q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    return out, _handle(q), _handle(q)


@torch.library.register_fake("mixattn::ovq_backward")
def _ovq_backward_fake(q, k, v, beta, grad_out, saved, block, max_centroids, growth,
                       growth_alpha, seeding, assignment, count_bias, grad_through_dictionary,
                       norm_eps, check_finite, initial_state=None, cu_seqlens=None):
    _same_device("ovq_backward", q, dict(locals()))
    return _like(q, k, v, beta)


@torch.library.register_fake("mixattn::ovq_forward_cached")
def _ovq_forward_cached_fake(q, k, v, beta, block, max_centroids, growth, growth_alpha, seeding,
                             assignment, count_bias, grad_through_dictionary, norm_eps,
                             check_finite, cache, save, cu_seqlens=None):
    _same_device("ovq_forward_cached", q, dict(locals()))
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3]), _handle(q)


@torch.library.register_fake("mixattn::flash_forward")
def _flash_forward_fake(q, k, v, causal, scale, check_finite, save, cu_seqlens=None):
    _same_device("flash_forward", q, dict(locals()))
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3]), _handle(q)


@torch.library.register_fake("mixattn::flash_backward")
def _flash_backward_fake(q, k, v, grad_out, saved, causal, scale, check_finite, cu_seqlens=None):
    _same_device("flash_backward", q, dict(locals()))
    return _like(q, k, v)


def _out(q, v):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


@torch.library.register_fake("mixattn::linear_forward")
def _linear_forward_fake(q, k, v, causal, eps, check_finite, save, cu_seqlens=None):
    _same_device("linear_forward", q, dict(locals()))
    return _out(q, v), _handle(q)


@torch.library.register_fake("mixattn::linear_backward")
def _linear_backward_fake(q, k, v, grad_out, saved, causal, eps, check_finite, cu_seqlens=None):
    _same_device("linear_backward", q, dict(locals()))
    return _like(q, k, v)


@torch.library.register_fake("mixattn::performer_forward")
def _performer_forward_fake(q, k, v, features, causal, eps, scale, check_finite, save,
                            cu_seqlens=None):
    _same_device("performer_forward", q, dict(locals()))
    return _out(q, v), _handle(q)


@torch.library.register_fake("mixattn::performer_backward")
def _performer_backward_fake(q, k, v, features, grad_out, saved, causal, eps, scale,
                             check_finite, cu_seqlens=None):
    _same_device("performer_backward", q, dict(locals()))
    return _like(q, k, v)


@torch.library.register_fake("mixattn::vq_forward")
def _vq_forward_fake(q, k, v, codebook, causal, eps, scale, check_finite, save,
                     cu_seqlens=None):
    _same_device("vq_forward", q, dict(locals()))
    return _out(q, v), _handle(q)


@torch.library.register_fake("mixattn::vq_backward")
def _vq_backward_fake(q, k, v, codebook, grad_out, saved, causal, eps, scale, check_finite,
                      cu_seqlens=None):
    _same_device("vq_backward", q, dict(locals()))
    return _like(q, k, v, codebook)


@torch.library.register_fake("mixattn::window_forward")
def _window_forward_fake(q, k, v, window, scale, check_finite, save, cu_seqlens=None):
    _same_device("window_forward", q, dict(locals()))
    return _out(q, v), _handle(q)


@torch.library.register_fake("mixattn::window_backward")
def _window_backward_fake(q, k, v, grad_out, saved, window, scale, check_finite,
                          cu_seqlens=None):
    _same_device("window_backward", q, dict(locals()))
    return _like(q, k, v)


def _delta_state(q, v, cu_seqlens):
    """A gated delta rule state: (streams, H, d_k, d_v), float64 whatever q's dtype."""
    return q.new_empty(_streams(q, cu_seqlens), q.shape[1], q.shape[3], v.shape[3],
                       dtype=torch.float64)


@torch.library.register_fake("mixattn::delta_forward")
def _delta_forward_fake(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, chunk_size,
                        check_finite, save, initial_state=None, cu_seqlens=None):
    _same_device("delta_forward", q, dict(locals()))
    return _out(q, v), _delta_state(q, v, cu_seqlens), _handle(q)


@torch.library.register_fake("mixattn::delta_backward")
def _delta_backward_fake(q, k, v, g, beta, grad_out, saved, scale, use_qk_l2norm_in_kernel,
                         chunk_size, check_finite, grad_final_state=None, initial_state=None,
                         cu_seqlens=None):
    _same_device("delta_backward", q, dict(locals()))
    return (*_like(q, k, v, g, beta), _delta_state(q, v, cu_seqlens))


@torch.library.register_fake("mixattn::rope_forward")
def _rope_forward_fake(x, start, base, check_finite, cu_seqlens=None):
    _same_device("rope_forward", x, dict(locals()))
    return _like(x)[0]


@torch.library.register_fake("mixattn::rope_backward")
def _rope_backward_fake(grad_out, start, base, check_finite, cu_seqlens=None):
    _same_device("rope_backward", grad_out, dict(locals()))
    return _like(grad_out)[0]


# --- autograd ------------------------------------------------------------------------------------
#
# setup_context keeps the forward's tensor inputs and its record (save_for_backward) and its
# options (attributes); the backward calls the backward operator with them. The non-tensor
# inputs get None. A backward operator's own autograd raises: the library's backward passes are
# hand-derived and first-order only.

def _first_order_only(name):
    def backward(ctx, *grads):
        raise RuntimeError(f"mixattn: {name} is first-order only: the library's backward is "
                           "hand-derived and has no derivative of its own (double backward)")
    return backward


def _keep(ctx, tensors, options):
    """save_for_backward of the tensors, None entries (an absent cu_seqlens or initial_state)
    kept aside: a compiled graph's saved tensors leave them out."""
    ctx.absent = tuple(t is None for t in tensors)
    ctx.save_for_backward(*(t for t in tensors if t is not None))
    ctx.options = options


def _kept(ctx):
    saved = iter(ctx.saved_tensors)
    return [None if absent else next(saved) for absent in ctx.absent]


def _gma_setup(ctx, inputs, output):
    q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor, check_finite, _, cu = inputs
    _keep(ctx, (q, k, v, mean, var_raw, prior_logit, output[1], cu),
          (causal, eps, var_floor, check_finite))


def _gma_backward(ctx, grad_out, _):
    *inputs, saved, cu = _kept(ctx)
    grads = ops.gma_backward(*inputs, grad_out, saved, *ctx.options, cu_seqlens=cu)
    return (*grads, None, None, None, None, None, None)


def _gma_state_setup(ctx, inputs, output):
    q, k, v, mean, var_raw, prior_logit, S0, z0, eps, var_floor, check_finite, _, cu, _ = inputs
    _keep(ctx, (q, k, v, mean, var_raw, prior_logit, S0, z0, output[3], cu),
          (eps, var_floor, check_finite))


def _gma_state_backward(ctx, grad_out, grad_S, grad_z, _):
    *inputs, saved, cu = _kept(ctx)
    grads = ops.gma_backward_state(*inputs, grad_out, grad_S, grad_z, saved, *ctx.options,
                                   cu_seqlens=cu)
    return (*grads, None, None, None, None, None, None)


def _gma_cached_setup(ctx, inputs, output):
    q, k, v, mean, var_raw, prior_logit, _, eps, var_floor, check_finite, _, cu = inputs
    _keep(ctx, (q, k, v, mean, var_raw, prior_logit, output[1], cu),
          (True, eps, var_floor, check_finite))


def _gma_cached_backward(ctx, grad_out, _):
    *inputs, saved, cu = _kept(ctx)
    grads = ops.gma_backward(*inputs, grad_out, saved, *ctx.options, cu_seqlens=cu)
    return (*grads, None, None, None, None, None, None)


def _ovq_setup(ctx, inputs, output):
    q, k, v, beta, *options = inputs
    start = None if isinstance(options[-2], bool) else options[-2]  # ovq_forward's initial_state
    _keep(ctx, (q, k, v, beta, output[1], start, options[-1]), tuple(options[:10]))


def _ovq_backward(ctx, grad_out, _record, _state):
    *inputs, saved, start, cu = _kept(ctx)
    grads = ops.ovq_backward(*inputs, grad_out, saved, *ctx.options, initial_state=start,
                             cu_seqlens=cu)
    return (*grads,) + (None,) * 13


def _ovq_cached_backward(ctx, grad_out, _record):
    *inputs, saved, start, cu = _kept(ctx)
    grads = ops.ovq_backward(*inputs, grad_out, saved, *ctx.options, initial_state=start,
                             cu_seqlens=cu)
    return (*grads,) + (None,) * 13


def _flash_setup(ctx, inputs, output):
    q, k, v, causal, scale, check_finite, _, cu = inputs
    _keep(ctx, (q, k, v, output[1], cu), (causal, scale, check_finite))


def _flash_backward(ctx, grad_out, _):
    *inputs, saved, cu = _kept(ctx)
    grads = ops.flash_backward(*inputs, grad_out, saved, *ctx.options, cu_seqlens=cu)
    return (*grads, None, None, None, None, None)


def _linear_setup(ctx, inputs, output):
    q, k, v, causal, eps, check_finite, _, cu = inputs
    _keep(ctx, (q, k, v, output[1], cu), (causal, eps, check_finite))


def _linear_backward(ctx, grad_out, _):
    *inputs, saved, cu = _kept(ctx)
    grads = ops.linear_backward(*inputs, grad_out, saved, *ctx.options, cu_seqlens=cu)
    return (*grads, None, None, None, None, None)


def _features_setup(ctx, inputs, output):
    """Performer's and VQ's: q, k, v and the per-head matrix (features, codebook)."""
    q, k, v, w, causal, eps, scale, check_finite, _, cu = inputs
    _keep(ctx, (q, k, v, w, output[1], cu), (causal, eps, scale, check_finite))


def _performer_backward(ctx, grad_out, _):
    *inputs, saved, cu = _kept(ctx)
    grads = ops.performer_backward(*inputs, grad_out, saved, *ctx.options, cu_seqlens=cu)
    return (*grads, None, None, None, None, None, None, None)  # features: a constant (SPEC 5.1)


def _vq_backward(ctx, grad_out, _):
    *inputs, saved, cu = _kept(ctx)
    grads = ops.vq_backward(*inputs, grad_out, saved, *ctx.options, cu_seqlens=cu)
    return (*grads, None, None, None, None, None, None)


def _window_setup(ctx, inputs, output):
    q, k, v, window, scale, check_finite, _, cu = inputs
    _keep(ctx, (q, k, v, output[1], cu), (window, scale, check_finite))


def _window_backward(ctx, grad_out, _):
    *inputs, saved, cu = _kept(ctx)
    grads = ops.window_backward(*inputs, grad_out, saved, *ctx.options, cu_seqlens=cu)
    return (*grads, None, None, None, None, None)


def _delta_setup(ctx, inputs, output):
    q, k, v, g, beta, scale, normalize, chunk, check_finite, _, start, cu = inputs
    _keep(ctx, (q, k, v, g, beta, output[2], start, cu), (scale, normalize, chunk, check_finite))


def _delta_backward(ctx, grad_out, grad_final_state, _):
    *inputs, saved, start, cu = _kept(ctx)
    *grads, grad_start = ops.delta_backward(*inputs, grad_out, saved, *ctx.options,
                                            grad_final_state=grad_final_state,
                                            initial_state=start, cu_seqlens=cu)
    return (*grads, None, None, None, None, None, None if start is None else grad_start, None)


def _rope_setup(ctx, inputs, output):
    _, start, base, check_finite, cu = inputs
    _keep(ctx, (cu,), (start, base, check_finite))


def _rope_backward(ctx, grad_out):
    (cu,) = _kept(ctx)
    return ops.rope_backward(grad_out, *ctx.options, cu_seqlens=cu), None, None, None, None


def _rope_backward_backward(ctx, grad_grad):
    """RoPE's backward is the inverse rotation, linear in its input: its derivative is the
    rotation itself, so RoPE differentiates to any order."""
    (cu,) = _kept(ctx)
    return ops.rope_forward(grad_grad, *ctx.options, cu_seqlens=cu), None, None, None, None


torch.library.register_autograd("mixattn::gma_forward", _gma_backward, setup_context=_gma_setup)
torch.library.register_autograd("mixattn::gma_forward_state", _gma_state_backward,
                                setup_context=_gma_state_setup)
torch.library.register_autograd("mixattn::ovq_forward", _ovq_backward, setup_context=_ovq_setup)
torch.library.register_autograd("mixattn::flash_forward", _flash_backward,
                                setup_context=_flash_setup)
torch.library.register_autograd("mixattn::linear_forward", _linear_backward,
                                setup_context=_linear_setup)
torch.library.register_autograd("mixattn::performer_forward", _performer_backward,
                                setup_context=_features_setup)
torch.library.register_autograd("mixattn::vq_forward", _vq_backward,
                                setup_context=_features_setup)
torch.library.register_autograd("mixattn::window_forward", _window_backward,
                                setup_context=_window_setup)
torch.library.register_autograd("mixattn::delta_forward", _delta_backward,
                                setup_context=_delta_setup)
torch.library.register_autograd("mixattn::rope_forward", _rope_backward,
                                setup_context=_rope_setup)
torch.library.register_autograd("mixattn::rope_backward", _rope_backward_backward,
                                setup_context=_rope_setup)
for _name in ("gma_backward", "gma_backward_state", "ovq_backward", "flash_backward",
              "linear_backward", "performer_backward", "vq_backward", "window_backward",
              "delta_backward"):
    torch.library.register_autograd(f"mixattn::{_name}", _first_order_only(_name))


# The cache forwards mutate their cache, and register_autograd takes functional operators only;
# their autograd kernels are registered directly, as register_autograd's own are: the operator
# below autograd inside an autograd.Function whose backward is the functional backward's.

def _mutating_autograd(op, setup_context, backward):
    class Forward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            with torch._C._AutoDispatchBelowAutograd():
                result = op.redispatch(keyset & torch._C._after_autograd_keyset, *args)
            setup_context(ctx, args, result)
            ctx.mark_non_differentiable(result[1])  # the record
            return result

        @staticmethod
        def backward(ctx, *grads):
            return (None, *backward(ctx, *grads))

    Forward.__name__ = f"{op._opname}_autograd"

    def kernel(keyset, *args, **kwargs):
        # Every argument in order: the dispatcher may pass some by name, or leave out trailing
        # ones equal to their defaults (None).
        args = args + tuple(kwargs.get(a.name) for a in op._schema.arguments[len(args):])
        return Forward.apply(keyset, *args)
    return kernel


_LIBRARY = torch.library.Library("mixattn", "IMPL")  # kept: dropping it unregisters the kernels
_LIBRARY.impl("gma_forward_cached",
              _mutating_autograd(ops.gma_forward_cached.default, _gma_cached_setup,
                                 _gma_cached_backward), "Autograd", with_keyset=True)
_LIBRARY.impl("ovq_forward_cached",
              _mutating_autograd(ops.ovq_forward_cached.default, _ovq_setup,
                                 _ovq_cached_backward), "Autograd", with_keyset=True)


# Sparse inputs reach no kernel: the dispatcher's own error names the operator, not the
# argument, so a kernel for the sparse layouts refuses by name.

def _refuse_sparse(name):
    op = getattr(ops, name).default
    names = [a.name for a in op._schema.arguments]

    def kernel(*args, **kwargs):
        for arg, value in [*zip(names, args), *kwargs.items()]:
            if isinstance(value, torch.Tensor) and value.layout is not torch.strided:
                raise ValueError(f"{_FUNCTIONS[name.split('_')[0]]}: {arg} must be a dense CPU "
                                 f"tensor, got a {value.device} {value.layout} tensor")
        raise ValueError(f"{_FUNCTIONS[name.split('_')[0]]}: every tensor must be a dense CPU "
                         "tensor")
    return kernel


for _name in ("gma_forward", "gma_backward", "gma_forward_state", "gma_backward_state",
              "gma_forward_cached", "ovq_forward", "ovq_backward", "ovq_forward_cached",
              "flash_forward", "flash_backward", "linear_forward", "linear_backward",
              "performer_forward", "performer_backward", "vq_forward", "vq_backward",
              "window_forward", "window_backward", "delta_forward", "delta_backward",
              "rope_forward", "rope_backward"):
    for _key in ("SparseCPU", "SparseCsrCPU"):
        _LIBRARY.impl(_name, _refuse_sparse(_name), _key)
