"""EpisodeCollector: accumulate a group-batched rollout in memory, then train on it or store it.

Vectorised environments step ``num_groups`` episodes in lock-step. The collector keeps their
steps in RAM with explicit layouts, so the time and group axes can never be silently swapped:

- ``append``: one step, group-batched ``(num_groups, *shape)`` or ``(num_groups, 1, *shape)``;
- ``extend``: whole trajectories, time-major ``(time, num_groups, *shape)`` (returns, advantages);
- ``time_major`` / ``env_major``: read back ``(time, num_groups, ...)`` / ``(num_groups, time, ...)``;
- ``all_data`` / ``dataloader``: env-major tensors / flattened minibatches, entirely in memory;
- ``store``: write one episode per group into the buffer, then ``clear``.

Values keep the type the caller gave (torch tensors stay tensors, numpy stays numpy), as in
memmap-replay-buffer's collector. Unlike it, values are copied on ``append`` / ``extend`` (a
caller reusing its observation array in place does not rewrite the collected rollout), a
rejected call changes nothing, and ``store`` writes all groups through the buffer's batched
write path after validating everything, so a bad rollout never leaves half its episodes behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from replaybuf.inputs import check_unmasked, tensor_to_numpy
from replaybuf.sampling.collate import named_batch_class
from replaybuf.schema import RESERVED_META_FIELDS, UnknownFieldError

__all__ = ["EpisodeCollector", "UnknownFieldError"]

ArrayLike = torch.Tensor | np.ndarray


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def _copy(value: ArrayLike) -> ArrayLike:
    return value.clone() if isinstance(value, torch.Tensor) else np.array(value)


def _stack(values: list, axis: int = 0) -> ArrayLike:
    """Stack like the caller's first value: torch if it is a tensor, numpy otherwise."""
    if isinstance(values[0], torch.Tensor):
        return torch.stack([torch.as_tensor(v, device=values[0].device) for v in values], dim=axis)
    return np.stack([np.asarray(v) for v in values], axis=axis)


def _concat(blocks: list[ArrayLike]) -> ArrayLike:
    """A new array of the blocks joined along time (the collector's own blocks stay private)."""
    if isinstance(blocks[0], torch.Tensor):
        return torch.cat([torch.as_tensor(b, device=blocks[0].device) for b in blocks], dim=0)
    return np.concatenate([np.asarray(b) for b in blocks], axis=0)


def _to_numpy(value: Any, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return tensor_to_numpy(value, name)
    return np.asarray(value)


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if _is_array(value) else np.shape(value)


def _check_numeric(name: str, value: ArrayLike) -> None:
    """Reject strings, objects, complex numbers (which no field stores) and masked items before
    they reach the rollout."""
    if isinstance(value, torch.Tensor) and value.is_complex():
        raise TypeError(f"field {name!r}: got a tensor of dtype {value.dtype}; expected numbers or bools")
    if isinstance(value, np.ndarray) and value.dtype.kind not in "biuf":
        raise TypeError(f"field {name!r}: got values of dtype {value.dtype}; expected numbers or bools")
    check_unmasked(value, name)


def _cast_singleton(value: Any, target: tuple[int, ...], leading: int) -> Any:
    """Treat a feature shape () and (1,) as the same, as the buffer's ``store_episode`` does."""
    feature = _shape(value)[leading:]
    if target == () and feature == (1,):
        return value[..., 0]
    if target == (1,) and feature == ():
        return value[..., None]
    return value


def _to_device(batch: Any, device: torch.device | str | None) -> Any:
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {name: _to_device(value, device) for name, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to_device(value, device) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(value, device) for value in batch)
    return batch


def _as_names(argument: str, names: Iterable[str] | None, known: Iterable[str]) -> set[str]:
    known = set(known)
    if names is None:
        return known
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"{argument} must be a tuple of field names, got {names!r}")
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"{argument}: unknown fields {unknown}; the buffer has {sorted(known)}")
    return set(names)


class _RolloutDataset(Dataset):
    """Equal-length tensors indexed along their first axis; batches in one fancy index per field."""

    def __init__(self, data: dict[str, torch.Tensor]):
        self.data = data
        self.num_samples = len(next(iter(data.values())))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: value[index] for name, value in self.data.items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return {name: value[index.to(value.device)] for name, value in self.data.items()}


class EpisodeCollector:
    """Accumulates a group-batched rollout step by step, then stores it or trains on it in memory.

    Parameters
    ----------
    replay_buffer
        The buffer ``store`` writes into; its field shapes define what ``append`` accepts.
    num_groups
        Number of episodes collected in lock-step (parallel environments).
    fieldnames, meta_fieldnames
        The fields to collect (default: all of the buffer's).
    strict
        Unknown field names raise (default); with ``strict=False`` they are ignored.
    """

    def __init__(
        self,
        replay_buffer: Any,
        num_groups: int,
        fieldnames: tuple[str, ...] | None = None,
        meta_fieldnames: tuple[str, ...] | None = None,
        strict: bool = True,
    ):
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
            raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
        self.replay_buffer = replay_buffer
        self.num_groups = int(num_groups)
        buffer_meta = set(replay_buffer.meta_fieldnames) - set(RESERVED_META_FIELDS)
        self.fieldnames = _as_names("fieldnames", fieldnames, replay_buffer.fieldnames)
        self.meta_fieldnames = _as_names("meta_fieldnames", meta_fieldnames, buffer_meta)
        self.shapes = {name: tuple(replay_buffer.shapes[name]) for name in self.fieldnames}
        self.meta_shapes = {name: tuple(replay_buffer.meta_shapes[name]) for name in self.meta_fieldnames}
        self.strict = strict
        self.clear()

    def __len__(self) -> int:
        return self._num_steps

    @property
    def step_count(self) -> int:
        """Steps collected so far (``len(collector)``), under the seed's name."""
        return self._num_steps

    def __repr__(self) -> str:
        return (
            f"EpisodeCollector(num_groups={self.num_groups}, steps={len(self)}, "
            f"fields={list(self._steps)}, meta_fields={list(self._meta)})"
        )

    def clear(self) -> None:
        """Discard the current rollout."""
        self._steps: dict[str, list[ArrayLike]] = {}  # data field -> time-major blocks (n, G, *shape)
        self._meta: dict[str, ArrayLike] = {}  # meta field -> latest per-group value (G, *shape)
        self._num_steps = 0

    # field lookup

    def _kind(self, name: str) -> str | None:
        """'data', 'meta', or None for an unknown name that ``strict=False`` ignores."""
        if name in self.fieldnames:
            return "data"
        if name in self.meta_fieldnames:
            return "meta"
        if self.strict:
            raise UnknownFieldError(
                f"unknown field {name!r}; valid fields are {sorted(self.fieldnames | self.meta_fieldnames)}"
            )
        return None

    def _per_group_meta(self, name: str, value: Any, call: str) -> ArrayLike:
        """A meta value as ``(num_groups, *shape)``: one value for all groups, or one per group."""
        shape = self.meta_shapes[name]
        value = value if _is_array(value) else np.asarray(value)
        _check_numeric(name, value)
        shared = _cast_singleton(value, shape, 0)
        if _shape(shared) == shape:
            return _stack([shared] * self.num_groups)
        per_group = _cast_singleton(value, shape, 1) if value.ndim >= 1 else value
        if _shape(per_group) == (self.num_groups, *shape):
            return _copy(per_group)
        raise ValueError(
            f"meta field {name!r}: `{call}` got shape {_shape(value)}; expected {shape} for all groups "
            f"or ({self.num_groups}, *{shape}) for one value per group"
        )

    def _step_block(self, name: str, value: Any) -> ArrayLike:
        """One group-batched step of a data field as a time-major block (1, num_groups, *shape)."""
        shape = self.shapes[name]
        expected = (
            f"`append` expects per-step group-batched values of shape ({self.num_groups}, *{shape}) "
            f"or ({self.num_groups}, 1, *{shape}); for whole trajectories in time-major "
            f"(time, {self.num_groups}, *{shape}), use `extend`"
        )
        if isinstance(value, (list, tuple)):
            if len(value) != self.num_groups:
                raise ValueError(f"field {name!r}: got a {type(value).__name__} of length {len(value)}; {expected}")
            try:
                value = _stack(list(value))
            except (RuntimeError, ValueError, TypeError) as error:
                raise ValueError(f"field {name!r}: per-group values do not stack ({error}); {expected}") from None
        elif not _is_array(value):
            raise TypeError(f"field {name!r}: got {type(value).__name__} {value!r}; {expected}")
        _check_numeric(name, value)
        if value.ndim == 0 or value.shape[0] != self.num_groups:
            raise ValueError(f"field {name!r}: got shape {_shape(value)}; {expected}")
        rest = _shape(value)[1:]
        if rest == (1, *shape):
            value = value[:, 0]
        elif rest != shape:
            raise ValueError(f"field {name!r}: per-group shape {rest} should be {shape} or {(1, *shape)}")
        return _copy(value)[None]

    # adding data

    def append(self, **data: Any) -> None:
        """Add one step: data fields group-batched, meta fields shared or one per group."""
        blocks, metas = {}, {}
        for name, value in data.items():
            kind = self._kind(name)
            if kind == "data":
                blocks[name] = self._step_block(name, value)
            elif kind == "meta":
                metas[name] = self._per_group_meta(name, value, "append")
        for name, block in blocks.items():
            self._steps.setdefault(name, []).append(block)
        self._meta.update(metas)
        self._num_steps += 1

    def extend(self, **trajectories: ArrayLike) -> None:
        """Add whole trajectories, time-major ``(time, num_groups, *shape)``.

        The time dimension must match the steps collected so far (or sets it, when empty).
        For meta fields the value at the last timestep is kept, per group.
        """
        blocks, metas = {}, {}
        num_steps = len(self) or None
        for name, value in trajectories.items():
            kind = self._kind(name)
            if kind is None:
                continue
            shape = self.shapes[name] if kind == "data" else self.meta_shapes[name]
            if not _is_array(value):
                raise TypeError(
                    f"field {name!r}: `extend` expects a tensor / ndarray of shape "
                    f"(time, {self.num_groups}, *{shape}), got {type(value).__name__}"
                )
            if value.ndim < 2 or value.shape[1] != self.num_groups or value.shape[0] == 0:
                raise ValueError(
                    f"field {name!r}: `extend` expects time-major (time, {self.num_groups}, *{shape}) "
                    f"with time >= 1, got {_shape(value)}"
                )
            if num_steps is None:
                num_steps = value.shape[0]
            elif value.shape[0] != num_steps:
                raise ValueError(
                    f"field {name!r}: time dim {value.shape[0]} does not match the rollout's {num_steps} steps"
                )
            if _shape(value)[2:] != shape:
                raise ValueError(f"field {name!r}: feature shape {_shape(value)[2:]} does not match {shape}")
            _check_numeric(name, value)
            if kind == "data":
                blocks[name] = _copy(value)
            else:
                metas[name] = _copy(value[-1])
        for name, block in blocks.items():
            self._steps.setdefault(name, []).append(block)
        self._meta.update(metas)
        if num_steps is not None and len(self) == 0:
            self._num_steps = num_steps

    # reading back

    def _require_collected(self, name: str) -> str:
        if name in self._steps:
            return "data"
        if name in self._meta:
            return "meta"
        raise UnknownFieldError(
            f"field {name!r} has not been collected; collected fields are {list(self._steps) + list(self._meta)}"
        )

    def time_major(self, name: str) -> ArrayLike:
        """``(time, num_groups, *shape)`` for a data field, ``(num_groups, *shape)`` for a meta field."""
        if self._require_collected(name) == "meta":
            return _copy(self._meta[name])
        return _concat(self._steps[name])

    def env_major(self, name: str) -> ArrayLike:
        """``(num_groups, time, *shape)``, the layout generalized advantage estimation expects."""
        values = self.time_major(name)
        if name in self._meta:
            return values
        return values.swapaxes(0, 1)

    def groups(self, name: str) -> list[ArrayLike]:
        """One value per group: ``(time, *shape)`` for data fields, ``shape`` for meta fields."""
        return list(self.env_major(name))

    def all_data(
        self, fields: tuple[str, ...] | None = None, device: torch.device | str | None = None
    ) -> dict[str, ArrayLike]:
        """Env-major ``(num_groups, time, *shape)`` values of the collected data fields (or ``fields``)."""
        if len(self) == 0:
            raise ValueError("collector is empty: append or extend some steps first")
        names = tuple(self._steps) if fields is None else tuple(fields)
        return _to_device({name: self.env_major(name) for name in names}, device)

    def dataloader(
        self,
        batch_size: int,
        fields: tuple[str, ...] | None = None,
        filter_fields: dict[str, Any] | None = None,
        to_named_tuple: tuple[str, ...] | None = None,
        shuffle: bool = False,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> DataLoader:
        """Minibatches of single steps, flattened over (num_groups, time), entirely in memory.

        ``filter_fields`` keeps the steps whose scalar fields equal the given values; other
        keywords go to torch's DataLoader.
        """
        data = {name: torch.as_tensor(value).reshape(-1, *value.shape[2:]) for name, value in self.all_data().items()}
        if filter_fields:
            mask = None
            for name, wanted in filter_fields.items():
                if name not in data:
                    raise ValueError(f"filter_fields: {name!r} is not a collected field; collected are {list(data)}")
                if data[name].ndim != 1:
                    raise ValueError(
                        f"filter_fields: field {name!r} has per-step shape {tuple(data[name].shape[1:])}; "
                        "only scalar fields can be filtered"
                    )
                matches = data[name] == wanted
                mask = matches if mask is None else mask & matches
            data = {name: value[mask] for name, value in data.items()}
        names = tuple(data) if fields is None else tuple(fields)
        missing = [name for name in names if name not in data]
        if missing:
            raise ValueError(f"fields: {missing} not collected; collected fields are {list(data)}")
        data = {name: data[name] for name in names}
        batch_type: type | None = None
        tuple_fields = () if to_named_tuple is None else tuple(to_named_tuple)
        if to_named_tuple is not None:
            missing = [name for name in tuple_fields if name not in data]
            if missing:
                raise ValueError(f"to_named_tuple: fields {missing} not found in batch; available fields: {list(data)}")
            batch_type = named_batch_class(tuple(name.lstrip("_") for name in tuple_fields))

        def collate(samples: Any) -> Any:
            batch = samples if isinstance(samples, dict) else default_collate(samples)
            if batch_type is not None:
                batch = batch_type(*(batch[name] for name in tuple_fields))
            return _to_device(batch, device)

        return DataLoader(_RolloutDataset(data), batch_size=batch_size, shuffle=shuffle, collate_fn=collate, **kwargs)

    # storing

    def _episode_data(self) -> dict[str, np.ndarray]:
        """The collected data fields as time-major numpy arrays (time, num_groups, *shape).

        Shapes were checked by ``append`` / ``extend``; what is left to check is that every field
        has the same number of steps and that they fit the buffer.
        """
        if not self._steps:
            raise ValueError("nothing to store: the collector holds no data field; append or extend steps first")
        arrays = {name: _to_numpy(self.time_major(name), name) for name in self._steps}
        lengths = {name: array.shape[0] for name, array in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"data fields were collected for different numbers of steps: {lengths}")
        num_steps = next(iter(lengths.values()))
        max_timesteps = self.replay_buffer.max_timesteps
        if num_steps > max_timesteps:
            raise ValueError(
                f"the rollout has {num_steps} steps, more than the buffer's max_timesteps ({max_timesteps})"
            )
        return arrays

    def store(self, **meta_data: Any) -> None:
        """Write one episode per group, in group order, then clear the collector.

        ``meta_data`` sets meta fields for every group (one value) or per group
        (``(num_groups, *shape)``), overriding collected meta values. Everything is validated
        before the first write; the groups are written through the buffer's
        ``batched_episode`` + ``store_batch``, as they share one length, without the step log:
        a process killed inside ``store`` leaves none of the rollout's episodes, never some cut short.
        """
        arrays = self._episode_data()
        meta = {name: _to_numpy(value, name) for name, value in self._meta.items()}
        for name, value in meta_data.items():
            if name in self.meta_fieldnames:
                meta[name] = _to_numpy(self._per_group_meta(name, value, "store"), name)
            elif self.strict:
                raise UnknownFieldError(f"store: unknown meta field {name!r}; valid are {sorted(self.meta_fieldnames)}")
        buffer = self.replay_buffer
        num_steps = next(iter(arrays.values())).shape[0]
        from .buffer import ReplayBuffer

        # the rollout is whole in RAM until this returns: a kill midway must not leave its
        # episodes committed cut short, as replaying a step log would (a buffer of another
        # kind, read-only, refuses batched_episode with its own message)
        if isinstance(buffer, ReplayBuffer):  # a refusal names this call, not the batched_episode it makes
            buffer._refuse_unwritable("EpisodeCollector.store")
        unlogged = buffer._unlogged() if isinstance(buffer, ReplayBuffer) else contextlib.nullcontext()
        with unlogged, buffer.batched_episode(self.num_groups, **meta):
            for t in range(num_steps):
                buffer.store_batch(**{name: array[t] for name, array in arrays.items()})
        self.clear()
