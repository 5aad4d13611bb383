"""Turning user values (tensors, arrays, lists, scalars) into checked numpy arrays.

Every check raises before anything is written, and names the field, what was given and what
was expected.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .schema import Field

# the torch float dtypes numpy has; the others (bfloat16, the float8s) are read as float32
NUMPY_FLOAT_TENSORS = ("torch.float16", "torch.float32", "torch.float64")


def tensor_to_numpy(tensor: Any, name: str) -> np.ndarray:
    """A numpy view of a torch tensor (on any device). Floats numpy has no dtype for (bfloat16,
    float8) come as float32, which holds each of their values exactly; a tensor numpy cannot
    take at all (quantized, sparse) is a TypeError naming the field."""
    try:
        tensor = tensor.detach().cpu()
    except (NotImplementedError, RuntimeError) as e:  # a tensor on the meta device holds no values
        raise TypeError(
            f"field {name!r}: cannot read the values of a tensor on device {tensor.device} ({e}); "
            "expected a tensor holding data"
        ) from e
    if tensor.is_floating_point() and str(tensor.dtype) not in NUMPY_FLOAT_TENSORS:
        tensor = tensor.float()
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError) as e:
        raise TypeError(f"field {name!r}: cannot turn a tensor of dtype {tensor.dtype} into an array ({e})") from e


def to_numpy(value: Any, name: str) -> np.ndarray:
    """A numpy view of a tensor / array / list / scalar; rejects strings and objects."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = tensor_to_numpy(value, name)
    check_unmasked(value, name)
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise TypeError(f"field {name!r}: cannot turn {type(value).__name__} into an array ({e})") from e
    if array.dtype == object and array.size and all(type(x) is int for x in array.flat):
        # Python ints beyond 64 bits, which numpy keeps as objects
        raise ValueError(
            f"field {name!r}: integers in [{min(array.flat)}, {max(array.flat)}] do not fit any numpy integer dtype"
        )
    if array.dtype.kind not in "biuf":
        raise TypeError(f"field {name!r}: expected numbers or bools, got dtype {array.dtype} ({type(value).__name__})")
    return array


def check_unmasked(value: Any, name: str) -> None:
    """ValueError for a masked array holding masked items: they hold no value to store, and
    ``np.asarray`` kept (and stored, silently) whatever their memory held."""
    if isinstance(value, np.ma.MaskedArray) and np.ma.is_masked(value):
        raise ValueError(
            f"field {name!r}: a masked array with {int(np.ma.count_masked(value))} masked value(s), which hold "
            "no value to store; expected plain values (value.filled(x) fills them, value.data keeps what they hold)"
        )


def cast_values(array: np.ndarray, f: Field) -> np.ndarray:
    """``array`` in the field's dtype, refusing casts that would corrupt values (NaN into ints,
    out-of-range integers, finite floats that would become infinite; fractional floats stay
    allowed as the seed truncates them)."""
    target = f.dtype
    if array.dtype == target:
        return array
    if target.kind in "iub" and array.dtype.kind == "f" and array.size and not np.isfinite(array).all():
        raise ValueError(f"field {f.name!r}: non-finite values (NaN/inf) cannot be stored in a {target} field")
    if target.kind in "iu" and array.dtype.kind in "iuf" and array.size:
        info = np.iinfo(target)
        # compared as Python numbers: numpy compares a float16 with int32's bounds in float16,
        # which overflows (a RuntimeWarning, an error under -W error)
        lo, hi = array.min().item(), array.max().item()
        # the cast truncates floats toward zero, as the seed's does: 255.9 is stored as 255 in a
        # uint8 field and -0.5 as 0, so the truncated values are the ones that must fit
        # (int(), not math.trunc: a long double's item() stays a NumPy scalar, which has no __trunc__)
        low, high = (int(lo), int(hi)) if array.dtype.kind == "f" else (lo, hi)
        if low < info.min or high > info.max:
            raise ValueError(
                f"field {f.name!r}: values in [{lo}, {hi}] do not fit dtype {target} (range [{info.min}, {info.max}])"
            )
    if target.kind != "f" or not array.size or not _may_overflow(array.dtype, target):
        return array.astype(target)
    with np.errstate(over="ignore"):
        out = array.astype(target)
    infinite = np.isinf(out)
    overflow = infinite & np.isfinite(array) if infinite.any() else infinite
    if overflow.any():
        largest = np.abs(array[overflow]).max()
        raise ValueError(
            f"field {f.name!r}: values up to {largest} do not fit dtype {target} (largest {np.finfo(target).max}); "
            "they would be stored as infinity"
        )
    return out


def _may_overflow(source: np.dtype, target: np.dtype) -> bool:
    """Whether finite values of dtype ``source`` can become infinite cast to the float ``target``:
    a narrower float (float64 into float32), or ints into float16."""
    if source.kind == "f":
        return source.itemsize > target.itemsize
    return source.kind in "iu" and target.itemsize < 4


def fit_shape(array: np.ndarray, f: Field, leading: int) -> np.ndarray:
    """Check the trailing (feature) shape of ``array`` after ``leading`` batch/time axes,
    accepting () for (1,) and (1,) for () as the seed does."""
    feature = array.shape[leading:]
    if feature == f.shape:
        return array
    if f.shape == () and feature == (1,):
        return array[..., 0]
    if f.shape == (1,) and feature == ():
        return array[..., None]
    lead = array.shape[:leading]
    raise ValueError(
        f"field {f.name!r}: got shape {tuple(array.shape)} (feature shape {feature} after leading axes {lead}), "
        f"expected feature shape {f.shape}"
    )


def step_value(value: Any, f: Field) -> np.ndarray:
    """One timestep (or one episode's meta value): a scalar broadcasts to the field's shape."""
    array = to_numpy(value, f.name)
    if array.ndim == 0 and f.shape != ():
        array = np.full(f.shape, array)
    return cast_values(fit_shape(array, f, 0), f)


def batch_value(value: Any, f: Field, batch: int) -> np.ndarray:
    """A (batch, *shape) value; a scalar or one unbatched value broadcasts over the batch, and a
    (batch, ...) value's feature axes of size 1 over the field's shape (one value per episode:
    ``(batch, 1)`` for a ``(3,)`` field), as the seed's numpy assignment broadcasts them."""
    array = to_numpy(value, f.name)
    target = (batch, *f.shape)
    if array.ndim == 0:
        array = np.full(target, array)
    elif array.shape == f.shape and (array.ndim == 0 or array.shape[0] != batch):
        array = np.broadcast_to(array, target)
    elif array.ndim == len(target) and array.shape[0] == batch and _broadcasts(array.shape[1:], f.shape):
        array = np.broadcast_to(array, target)
    if array.shape[0] != batch:
        raise ValueError(f"field {f.name!r}: batch size {array.shape[0]} does not match the group's {batch}")
    return cast_values(fit_shape(array, f, 1), f)


def _broadcasts(feature: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether each axis of ``feature`` is 1 or the field ``shape``'s own (same rank)."""
    return all(size in (1, full) for size, full in zip(feature, shape, strict=True))


def fill_value(f: Field) -> np.ndarray:
    """One step of the field's default. A stored default an int or bool dtype cannot hold (a seed
    folder's ``('uint8', (), -1)``, NaN for an int) raises a ValueError naming the field, where
    numpy raised OverflowError or stored INT_MIN; a float default is cast as the seed cast it
    (1e300 is infinity in float32)."""
    if f.dtype.kind != "f":
        try:
            cast_values(np.asarray(f.fill), f)
        except ValueError as e:
            reason = str(e).removeprefix(f"field {f.name!r}: ")
            raise ValueError(f"field {f.name!r}: the stored default {f.default!r} does not fit: {reason}") from None
    return np.full(f.shape, f.fill, dtype=f.dtype)


def check_flag(name: str, value: Any) -> None:
    """TypeError unless ``value`` of the flag argument ``name`` is a bool (or 0 / 1): a string
    such as "false" from a config file or the command line is true to Python, and
    ``overwrite="false"`` erased the buffer it was meant to keep."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return
    raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__}); nothing was done")


def check_index(value: Any, size: int, name: str, call: str) -> int:
    """``value`` as an int index in ``[0, size)``; ValueError naming ``call`` and ``name`` otherwise
    (a bool or a float is refused, not taken as 0, 1 or truncated; a 0-d integer tensor or array
    is its int, as the seed indexes with it)."""
    index = None
    if np.ndim(value) == 0 and str(getattr(value, "dtype", type(value).__name__)) not in BOOL_NAMES:
        try:
            index = operator.index(value)
        except TypeError:
            pass
    if index is None:  # an array of several, a float, a bool: no index at all, whatever its values
        raise ValueError(f"{call}: {name} must be one int in [0, {size}), got {value!r}")
    if not 0 <= index < size:
        raise ValueError(f"{call}: {name} {value!r} out of range - must be in [0, {size})")
    return index


# how a bool, a numpy bool, a bool array and a torch bool tensor name their type
BOOL_NAMES = ("bool", "torch.bool")
