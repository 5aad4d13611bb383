"""Comparing replaybuf's outputs with memmap-replay-buffer's: same types, dtypes, shapes, values."""

from __future__ import annotations

import numpy as np
import torch


def assert_same(ours, theirs, where: str = "value") -> None:
    """Same container type, dtype, shape and values, recursively through dicts and (named) tuples."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: expected a tensor, got {type(ours).__name__}"
        assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype}, expected {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{where}: shape {tuple(ours.shape)}, expected {tuple(theirs.shape)}"
        assert torch.equal(ours.cpu(), theirs.cpu()), f"{where}: values differ"
    elif isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), f"{where}: expected an ndarray, got {type(ours).__name__}"
        assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype}, expected {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{where}: shape {ours.shape}, expected {theirs.shape}"
        np.testing.assert_array_equal(ours, theirs, err_msg=where)
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict), f"{where}: expected a dict, got {type(ours).__name__}"
        assert sorted(ours) == sorted(theirs), f"{where}: keys {sorted(ours)}, expected {sorted(theirs)}"
        for name in theirs:
            assert_same(ours[name], theirs[name], f"{where}[{name!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours).__name__ == type(theirs).__name__, (
            f"{where}: {type(ours).__name__}, expected {type(theirs).__name__}"
        )
        assert len(ours) == len(theirs), f"{where}: length {len(ours)}, expected {len(theirs)}"
        if hasattr(theirs, "_fields"):
            assert ours._fields == theirs._fields, f"{where}: fields {ours._fields}, expected {theirs._fields}"
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert ours == theirs, f"{where}: {ours!r}, expected {theirs!r}"
