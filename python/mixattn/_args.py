"""The Python-side checks of mixattn's arguments: the types the kernels cannot see (a list where
a tensor belongs, a float where an integer does) are refused here with TypeError naming the
function and the argument; shapes, dtypes, devices and values are checked by the kernels'
bindings (ValueError)."""

import math
import numbers
import operator

import torch


def tensors(fn, names, values):
    """Each value a torch.Tensor (the bindings check devices, dtypes and shapes)."""
    for name, t in zip(names, values):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")


def dense(fn, names, values):
    """Each tensor a dense CPU one, checked before the autograd paths make them contiguous in
    Python (a sparse CSR tensor cannot be); the message is the bindings' own."""
    for name, t in zip(names, values):
        if not t.is_cpu or t.layout is not torch.strided:
            where = str(t.device) + ("" if t.layout is torch.strided else f" {t.layout}")
            raise ValueError(f"{fn}: {name} must be a dense CPU tensor, got a {where} tensor")


def real(fn, name, x):
    """x as a float: a Python or NumPy real number (or a one-element tensor), not a bool."""
    if type(x) is float:
        return x
    if isinstance(x, (bool, str, bytes)) or x is None:
        raise TypeError(f"{fn}: {name} must be a real number, got {type(x).__name__}")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: {name} must be a real number, got {type(x).__name__}") from None


def integer(fn, name, x):
    """x as an int: an integer (Python, NumPy, a one-element integer tensor) or an integral
    float; a fractional value is refused rather than truncated."""
    if type(x) is int:
        return x
    if not isinstance(x, bool):
        try:
            return operator.index(x)
        except TypeError:
            if isinstance(x, numbers.Real) and math.isfinite(x) and float(x).is_integer():
                return int(x)
    raise TypeError(f"{fn}: {name} must be an integer, got {x!r}")


def flag(fn, name, x):
    """x as a bool: True, False (Python or NumPy), or the integers 0 and 1."""
    if x is True or x is False:
        return x
    if type(x).__module__ == "numpy" and type(x).__name__ in ("bool_", "bool"):  # numpy.bool_
        return bool(x)
    if not isinstance(x, float):
        try:
            i = operator.index(x)
            if i in (0, 1):
                return bool(i)
        except TypeError:
            pass
    raise TypeError(f"{fn}: {name} must be True or False, got {x!r}")


def offsets(fn, cu_seqlens, q):
    """cu_seqlens as the 1-D integer CPU tensor the operators take. In eager mode its values are
    checked here (N + 1 offsets, 0 first, nondecreasing, T last); under torch.compile, where
    reading them would break the graph, the kernel checks them when the graph runs."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise ValueError(f"{fn}: cu_seqlens must be a CPU tensor, got a "
                             f"{cu_seqlens.device.type} tensor")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{fn}: cu_seqlens must be a 1-D int32 or int64 tensor, got "
                             f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        if torch.compiler.is_compiling():
            return cu_seqlens
        values, tensor = cu_seqlens.tolist(), cu_seqlens
    else:
        try:
            values = [operator.index(x) for x in cu_seqlens]
        except TypeError:
            raise TypeError(f"{fn}: cu_seqlens must be a 1-D int32/int64 tensor or a sequence of "
                            f"integers, got {cu_seqlens!r}") from None
        tensor = torch.tensor(values, dtype=torch.int64)
        if torch.compiler.is_compiling():
            return tensor
    tokens = q.shape[2] if q.dim() == 4 else None
    if (len(values) < 2 or values[0] != 0 or values[-1] != tokens
            or any(a > b for a, b in zip(values, values[1:]))):
        raise ValueError(f"{fn}: cu_seqlens is {values}; it must hold N + 1 >= 2 nondecreasing "
                         f"offsets from 0 to the {tokens} tokens of q (shape {tuple(q.shape)})")
    return tensor


def beta(fn, b, q):
    """OVQ's beta as a tensor of q's dtype: a tensor as is; a real number for every head; a list,
    tuple or NumPy array as the per-head values."""
    if isinstance(b, torch.Tensor):
        return b
    if isinstance(b, (bool, str, bytes)) or b is None:
        raise TypeError(f"{fn}: beta must be a tensor of one value per head, a number or a "
                        f"sequence of numbers, got {type(b).__name__}")
    dtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float64
    if isinstance(b, numbers.Real):
        heads = q.shape[1] if q.dim() == 4 else 1
        return torch.full((heads,), float(b), dtype=dtype)
    try:
        t = torch.as_tensor(b, dtype=dtype)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{fn}: beta must be a tensor of one value per head, a number or a "
                        f"sequence of numbers, got {b!r}") from None
    return t
