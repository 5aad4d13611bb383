"""``make_dataset`` / ``make_dataloader``: what ``ReplayBuffer.dataset`` and
``ReplayBuffer.dataloader`` do, with the seed's signatures and checks."""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from ..inputs import check_flag
from ..schema import UnknownFieldError
from ..view import BufferView
from .collate import Collator, named_batch_class, named_tuple_fields
from .datasets import (
    ReplayDatasetNStep,
    ReplayDatasetTimestep,
    ReplayDatasetTrajectory,
    check_names,
    draws_timepoints,
    empty_buffer_error,
    refresh_for_snapshot,
)
from .distributed import ResumableDataLoader, ResumableDistributedSampler, check_int, resolve_rank
from .mixture import MixtureBatchSampler, PassDataLoader
from .prioritized import PrioritizedBatchSampler
from .ratelimit import RateLimitedLoader, RateLimiter

SAMPLERS = ("uniform", "prioritized")
# make_dataloader's arguments that configure the rate limiter, not each pass's loader
_RATE_ARGUMENTS = ("samples_per_insert", "min_size", "error_buffer", "rate_timeout")


class _Default:
    """A parameter's default value, told apart from the same value passed: the rate limiter's
    arguments passed without ``samples_per_insert`` are refused even when they equal it."""

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:  # help() shows the value
        return repr(self.value)


_MIN_SIZE, _RATE_TIMEOUT = _Default(1), _Default(60.0)
# keywords make_dataloader passes on: to the dataset, to a mixture's or prioritized sampler, to torch's DataLoader
_PASSED_ON = {"slice_by_episode_len", "return_episode_lens", "cache", "num_batches"} | (
    set(inspect.signature(DataLoader.__init__).parameters) - {"self", "dataset"}
)


def warn_if_no_batch(loader: Any) -> None:
    """Warn where a loader of ``buffer.dataloader`` yields no batch: ``drop_last`` with fewer
    samples (on this rank) than ``batch_size``, which torch's loader ends at once, so a training
    loop over it runs no step. A warning, not an error: the seed's loader is empty there too, and
    a loop written for it (made while the buffer is small) must run as it did. (Not for a
    rate-limited loader, whose later passes hold more, nor for samplers that draw their batches.)"""
    if not isinstance(loader, DataLoader) or not loader.drop_last or loader.batch_size is None:
        return
    try:
        samples = len(loader.sampler)  # type: ignore[arg-type]  # a custom sampler may have no length
    except TypeError:
        return
    if samples < loader.batch_size:
        rank = " on this rank" if isinstance(loader.sampler, ResumableDistributedSampler) else ""
        warnings.warn(
            f"batch_size={loader.batch_size} with drop_last=True: the loader has {samples} samples{rank}, so it "
            f"yields no batch; pass a batch_size of at most {samples}, or leave drop_last out",
            stacklevel=3,
        )


def _check_keywords(kwargs: dict[str, Any]) -> None:
    """Refuse a keyword neither make_dataloader nor what it passes keywords on to takes (a
    misspelt ``timestep_levl``), naming the close ones: torch's "DataLoader.__init__() got an
    unexpected keyword argument" named neither, and came only after the dataset was made (or,
    rate-limited on an empty buffer, after waiting for ``min_size`` steps)."""
    unknown = sorted(set(kwargs) - _PASSED_ON)
    if not unknown:
        return
    known = _PASSED_ON | (set(inspect.signature(make_dataloader).parameters) - {"buffer", "kwargs"})
    close = [name for key in unknown for name in difflib.get_close_matches(key, known, n=1, cutoff=0.7)]
    raise TypeError(
        f"dataloader() got unexpected keyword argument(s) {unknown}"
        + (f"; did you mean {' or '.join(map(repr, close))}?" if close else "")
        + " (it takes the dataset's and the sampler's arguments and torch DataLoader's)"
    )


# indices a shuffled pass turns into Python ints at a time (ShuffledSampler)
_ORDER_PIECE = 4096


class ShuffledSampler(RandomSampler):
    """``shuffle=True``: torch's RandomSampler, the same order for the same seed, with the
    permutation kept as a tensor (8 bytes a sample) and handed out in pieces. torch's makes
    the whole permutation one Python list, twice per pass: at 2 million timesteps ~80 MB
    each and ~0.1 s before the first batch."""

    def __iter__(self):
        if self.replacement or self._num_samples is not None:
            yield from super().__iter__()
            return
        generator = self.generator
        if generator is None:  # as RandomSampler seeds its own, from torch's global generator
            generator = torch.Generator()
            generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        order = torch.randperm(len(self.data_source), generator=generator)
        for start in range(0, len(order), _ORDER_PIECE):
            yield from order[start : start + _ORDER_PIECE].tolist()


def check_device(device: torch.device | str) -> None:
    """A ValueError naming ``device`` when it is not a torch device or is a CUDA device this
    machine lacks (torch would fail at the first batch, deep in its own code)."""
    try:
        parsed = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device: {device!r} is not a torch device ({e})") from None
    if parsed.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(
            f"device: {device!r}, but no CUDA device is available here (torch.cuda.is_available() is False)"
        )
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"device: {device!r}, but this machine has {count} CUDA device(s): cuda:0 .. cuda:{count - 1}")


def make_dataset(
    buffer: BufferView,
    n_steps: int | None = None,
    fields: Sequence[str] | None = None,
    current_fields: Sequence[str] | None = None,
    next_fields: Sequence[str] | None = None,
    sequence_fields: Sequence[str] | None = None,
    timestep_level: bool = False,
    filter_meta: dict | None = None,
    filter_fields: dict | None = None,
    fieldname_map: dict[str, str] | None = None,
    slice_by_episode_len: bool = True,
    return_episode_lens: bool = True,
    **kwargs: Any,
) -> Dataset:
    """A trajectory, timestep (``timestep_level``) or n-step (``n_steps``) dataset of ``buffer``.

    The dataset holds the episodes committed now (a read-only buffer is refreshed first). Other
    keywords go to the dataset class: ``return_indices``, ``include_metadata``, and ``cache``
    (``'ram'`` or ``'memmap'``, the same: decode the snapshot's episodes now into the read
    cache, raw files under the user's cache folder that DataLoader workers and later runs map;
    default: read through the storage, whose decoded-chunk cache
    ``replaybuf.sampling.chunk_cache()`` can be resized).
    """
    if len(buffer) == 0:
        refresh_for_snapshot(buffer)
    if len(buffer) == 0:
        raise empty_buffer_error(buffer)
    if n_steps is not None and timestep_level:
        raise ValueError("cannot specify both n_steps and timestep_level")
    if "window_length" in kwargs:  # the seed's dataset() swallowed it, giving whole trajectories
        raise TypeError(
            "dataset() takes no window_length: windows of steps are "
            "ReplayDatasetTimeWindow(buffer, window_length=...) (a loader: buffer.dataloader(batch_size, dataset=...))"
        )
    common = dict(filter_meta=filter_meta, filter_fields=filter_fields, fieldname_map=fieldname_map, **kwargs)
    if n_steps is not None:
        check_names(fields, buffer.fieldnames, "fields")
        return ReplayDatasetNStep(
            buffer,
            n_steps=n_steps,
            current_fields=current_fields,
            next_fields=next_fields,
            sequence_fields=sequence_fields,
            **common,
        )
    for name, value in (
        ("current_fields", current_fields),
        ("next_fields", next_fields),
        ("sequence_fields", sequence_fields),
    ):
        check_names(value, buffer.fieldnames, name)
    if timestep_level:
        return ReplayDatasetTimestep(buffer, fields=fields, **common)
    return ReplayDatasetTrajectory(
        buffer,
        fields=fields,
        slice_by_episode_len=slice_by_episode_len,
        return_episode_lens=return_episode_lens,
        **common,
    )


def _check_sharding(sampler: Any, rank: int | None, world_size: int | None, seed: int | None) -> None:
    """Refuse DDP arguments that would be lost: a ``world_size`` without a ``rank`` outside
    torch.distributed (``resolve_rank``), and any of them beside a custom sampler, which picks
    the positions itself (every rank would read the same ones)."""
    sharding = [f"{n}={v!r}" for n, v in (("rank", rank), ("world_size", world_size), ("seed", seed)) if v is not None]
    if sampler is not None and not isinstance(sampler, str) and sharding:
        raise ValueError(
            f"{', '.join(sharding)} cannot be combined with a custom sampler, which picks the positions "
            "itself: shard them in the sampler (e.g. torch's DistributedSampler), or leave sampler out"
        )
    resolve_rank(rank, world_size)


def make_dataloader(
    buffer: BufferView,
    batch_size: int,
    n_steps: int | None = None,
    dataset: Dataset | None = None,
    fields: Sequence[str] | None = None,
    current_fields: Sequence[str] | None = None,
    next_fields: Sequence[str] | None = None,
    sequence_fields: Sequence[str] | None = None,
    filter_meta: dict | None = None,
    filter_fields: dict | None = None,
    fieldname_map: dict[str, str] | None = None,
    return_indices: bool = False,
    return_mask: bool = False,
    timestep_level: bool = False,
    to_named_tuple: Sequence[str] | None = None,
    shuffle: bool = False,
    device: torch.device | str | None = None,
    dataset_kwargs: dict | None = None,
    sampler: Any = None,
    priority_field: str = "priority",
    alpha: float = 0.6,
    beta: float = 0.4,
    rank: int | None = None,
    world_size: int | None = None,
    seed: int | None = None,
    samples_per_insert: float | None = None,
    min_size: int = _MIN_SIZE,  # type: ignore[assignment]  # 1, told from a 1 passed
    error_buffer: float | None = None,
    rate_timeout: float | None = _RATE_TIMEOUT,  # type: ignore[assignment]  # 60 s, told from a 60 passed
    **kwargs: Any,
) -> DataLoader | RateLimitedLoader:
    """A DataLoader over ``buffer`` (or over ``dataset``), batches assembled by the dataset.

    ``sampler='prioritized'`` draws timesteps or n-step starts by ``priority_field``
    (``alpha``, ``beta``; ``num_batches`` per pass, default one dataset's worth; draws seeded by
    ``seed`` and the rank, so DDP ranks draw differently) and adds ``_indices``, ``_weights``
    and ``_generations`` (what ``update_priorities`` takes); ``slice_by_episode_len``, ``return_episode_lens`` and ``cache`` go to the
    dataset; any other ``sampler`` and every other keyword go to torch's DataLoader
    (``num_workers``, ``drop_last``, ``pin_memory``, ...).

    ``rank`` / ``world_size`` (default: torch.distributed's when it is initialized) shard the
    samples across ranks per epoch, with ``seed`` for a reproducible order (each share padded to
    ``ceil(len / world_size)`` by repeating samples, as torch's DistributedSampler does, or with
    ``drop_last`` cut to ``len // world_size``: then no sample is in two ranks' batches); the
    loader then has ``sampler.set_epoch(e)`` and ``state_dict()`` / ``load_state_dict()`` to
    resume mid-epoch. Beside a custom ``sampler`` (which picks the positions itself) ``rank``,
    ``world_size`` and ``seed`` are refused rather than ignored.

    ``samples_per_insert=R`` rate-limits the loader (``ratelimit.RateLimiter``, Reverb's
    SampleToInsertRatio): a batch is handed out only once ``min_size`` steps are committed and
    while samples handed out stay within ``R * (committed steps - min_size) + error_buffer``
    (default: one batch); it waits for the writer, rereading the store, and raises
    ``RateLimitTimeout`` after ``rate_timeout`` seconds. Each pass then covers the episodes
    committed when it starts.

    Over a ``ConcatReplayBuffer`` made with ``weights``, each sample's source is drawn with those
    probabilities (``mixture.MixtureBatchSampler``; ``num_batches`` per pass, ``seed``), and the
    loader has ``state_dict()`` / ``load_state_dict()``.
    """
    if samples_per_insert is None:
        given = [
            f"{name}={value!r}"
            for name, value in (("min_size", min_size), ("error_buffer", error_buffer), ("rate_timeout", rate_timeout))
            if not isinstance(value, _Default) and not (name == "error_buffer" and value is None)
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)}: {'applies' if len(given) == 1 else 'apply'} only to a rate-limited loader; "
                "pass samples_per_insert=R too (samples_per_insert=float('inf') waits for min_size steps, "
                "then samples freely)"
            )
    _check_keywords(kwargs)
    _check_sharding(sampler, rank, world_size, seed)  # here: a rate-limited loader makes its loaders later
    check_flag("return_mask", return_mask)  # the seed's beartype refuses a non-bool too
    return_mask = bool(return_mask)
    min_size = min_size.value if isinstance(min_size, _Default) else min_size
    rate_timeout = rate_timeout.value if isinstance(rate_timeout, _Default) else rate_timeout
    if samples_per_insert is not None:
        # every argument but the rate's, for the loader of each pass (locals(): the parameters only, here)
        options = {name: value for name, value in locals().items() if name not in _RATE_ARGUMENTS}
        options.update(options.pop("kwargs"))
        limiter = RateLimiter(
            buffer, samples_per_insert, min_size, batch_size if error_buffer is None else error_buffer, rate_timeout
        )
        if len(buffer) > 0:
            # one loader now, so a bad argument (a field name, batch_size, a DataLoader keyword)
            # fails here and not when the first pass begins, after waiting for min_size steps
            make_dataloader(**options)
        return RateLimitedLoader(lambda: make_dataloader(**options), limiter)
    if dataset_kwargs is not None and not isinstance(dataset_kwargs, dict):  # dict() of it fails obscurely
        raise TypeError(f"dataset_kwargs must be a dict of the dataset's keyword arguments, got {dataset_kwargs!r}")
    dataset_kwargs = dict(dataset_kwargs or {})
    for name in ("slice_by_episode_len", "return_episode_lens", "cache"):
        if name in kwargs:
            dataset_kwargs[name] = kwargs.pop(name)
    if len(buffer) == 0:
        refresh_for_snapshot(buffer)
    if len(buffer) == 0:
        raise empty_buffer_error(buffer)
    batch_size = check_int("batch_size", batch_size, 1)  # a numpy int too, passed on as int (torch refuses it)
    if to_named_tuple is not None and fields is not None:
        raise ValueError("cannot specify both fields and to_named_tuple")
    if to_named_tuple is not None and isinstance(to_named_tuple, str):
        raise TypeError(f"to_named_tuple must be a sequence of names, got the string {to_named_tuple!r}")
    if return_mask and (timestep_level or n_steps is not None):
        raise ValueError("return_mask is only supported for trajectory-level data")
    if n_steps is not None and timestep_level:
        raise ValueError("cannot specify both n_steps and timestep_level")
    named = sampler if isinstance(sampler, str) else None
    if named is not None and named not in SAMPLERS:
        raise ValueError(f"sampler must be one of {list(SAMPLERS)} or a torch Sampler, got {sampler!r}")
    # a torch Sampler or any iterable of positions (a list, a numpy array, a tensor), as torch takes
    custom = sampler is not None and named is None
    if custom and not hasattr(sampler, "__iter__"):
        raise TypeError(
            f"sampler must be one of {list(SAMPLERS)} or a torch Sampler (an iterable of dataset positions), "
            f"got {type(sampler).__name__}"
        )
    prioritized = named == "prioritized"
    if prioritized and shuffle:
        raise ValueError("shuffle cannot be combined with sampler='prioritized' (it draws its own order)")
    from ..concat import ConcatReplayBuffer

    # (weights, member offsets) of a ConcatReplayBuffer made with weights
    weighted: tuple[np.ndarray, np.ndarray] | None = None
    if isinstance(buffer, ConcatReplayBuffer) and buffer.weights is not None:
        weighted = (buffer.weights, buffer.storage.offsets)
    if weighted is not None and (prioritized or custom):
        raise ValueError(
            f"sampler={sampler!r} cannot be combined with a ConcatReplayBuffer's weights (they draw the batches)"
        )
    if dataset is None:
        dataset = make_dataset(
            buffer,
            n_steps=n_steps,
            fields=fields,
            current_fields=current_fields,
            next_fields=next_fields,
            sequence_fields=sequence_fields,
            timestep_level=timestep_level,
            return_indices=return_indices or prioritized,
            filter_meta=filter_meta,
            filter_fields=filter_fields,
            fieldname_map=fieldname_map,
            **dataset_kwargs,
        )
    added = ["_mask"] * return_mask + ["_weights", "_generations"] * prioritized  # the loader's own keys
    taken = [key for key in added if hasattr(dataset, "output_keys") and key in dataset.output_keys()]
    mapped = [key for key in taken if key in (getattr(dataset, "fieldname_map", None) or {}).values()]
    if mapped:
        raise ValueError(
            f"fieldname_map: {mapped} would be overwritten by the loader's own {mapped} - map to other names"
        )
    # a field named _mask is replaced by the loader's _mask, as the seed replaces a meta field so
    # named (and as the dataset's _lens replaces a field named _lens); the prioritized sampler's
    # keys have no such precedent
    taken = [key for key in taken if key != "_mask"]
    if taken:
        raise ValueError(
            f"field(s) {taken} would be overwritten by the prioritized sampler's own {taken} - "
            "return them under other names with fieldname_map"
        )
    if return_mask and hasattr(dataset, "output_keys") and "_lens" not in dataset.output_keys():
        kind = type(dataset).__name__ + (", return_episode_lens=False" * hasattr(dataset, "return_episode_lens"))
        raise UnknownFieldError(
            f"return_mask builds _mask from each sample's length, and this dataset returns no _lens ({kind}); "
            "return_mask is only supported for trajectory-level data with episode lengths"
        )
    trajectories = n_steps is None and not timestep_level and not draws_timepoints(dataset)
    # the names the fields have in a batch: under the loader's fieldname_map (the seed's padding)
    # and under that of a dataset given (its own outputs), so ``_mask`` spans its time axis too
    renames = (fieldname_map or {}, getattr(dataset, "fieldname_map", None) or {})
    time_keys = {rename.get(f, f) for rename in renames for f in buffer.fieldnames} if trajectories else None
    if to_named_tuple is not None:
        to_named_tuple = tuple(to_named_tuple)
        if hasattr(dataset, "output_keys"):
            available = dataset.output_keys() + added
            check_names(to_named_tuple, available, "to_named_tuple")
        try:  # made now, so names a namedtuple refuses fail here and not at the first batch
            named_batch_class(named_tuple_fields(to_named_tuple))
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"to_named_tuple {to_named_tuple!r}: {e} (a leading underscore is dropped: '_lens' is 'lens')"
            ) from None
    if device is not None:
        check_device(device)
    collate = Collator(time_keys, return_mask, to_named_tuple, device)
    if prioritized:
        for name in ("batch_sampler", "drop_last"):
            if name in kwargs:
                raise ValueError(f"{name} cannot be combined with sampler='prioritized'")
        batches = PrioritizedBatchSampler(
            dataset,
            batch_size,
            priority_field,
            alpha,
            beta,
            num_batches=kwargs.pop("num_batches", None),
            seed=seed,
            rank=resolve_rank(rank, world_size)[0],
        )
        return PassDataLoader(dataset, batches, collate_fn=collate, **kwargs)
    if weighted is not None:
        for name in ("batch_sampler", "drop_last"):
            if name in kwargs:
                raise ValueError(f"{name} cannot be combined with a ConcatReplayBuffer's weights")
        mixture = MixtureBatchSampler(
            dataset,
            batch_size,
            *weighted,
            num_batches=kwargs.pop("num_batches", None),
            seed=seed,
            rank=resolve_rank(rank, world_size)[0],
        )
        return PassDataLoader(dataset, mixture, collate_fn=collate, **kwargs)
    if "num_batches" in kwargs:  # torch would say only "unexpected keyword argument"
        raise ValueError(
            f"num_batches={kwargs['num_batches']!r} applies only to sampler='prioritized' or a ConcatReplayBuffer "
            "made with weights, which draw that many batches a pass; other loaders make one pass over the dataset "
            "(stop iterating after the batches you need)"
        )
    if custom:
        kwargs["sampler"] = sampler
    elif rank is not None or world_size is not None or seed is not None or resolve_rank()[1] > 1:
        order = ResumableDistributedSampler(
            dataset,  # type: ignore[arg-type]  # map-style datasets have __len__; torch's Dataset does not declare it
            rank=rank,
            world_size=world_size,
            shuffle=shuffle,
            seed=seed,
            # each rank's share cut to len // world_size too: padding it by repeating samples
            # would put them in two ranks' batches, which drop_last asked to avoid
            drop_last=bool(kwargs.get("drop_last", False)),
        )
        return ResumableDataLoader(dataset, batch_size=batch_size, collate_fn=collate, sampler=order, **kwargs)
    if shuffle and "sampler" not in kwargs and "batch_sampler" not in kwargs:
        kwargs["sampler"] = ShuffledSampler(dataset, generator=kwargs.get("generator"))  # type: ignore[arg-type]
        shuffle = False
    return DataLoader(dataset, batch_size=batch_size, collate_fn=collate, shuffle=shuffle, **kwargs)
