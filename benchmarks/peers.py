"""Adapters that give replaybuf and its peers the same small interface for the benchmarks.

Every sampling adapter has ``fill_episode(episode)`` + ``finish_fill()``, ``loader(kind,
batch_size, num_workers)`` returning an iterable of batches, ``folders()`` (to warm the OS
cache) and ``close()``; the seed-API adapter also has ``open``/``store_steps``/``store_episodes``
for the write benchmark.
Kinds: ``timestep`` (single random timesteps), ``nstep`` (frame/state at t and t+n, plus
action/reward/done for t..t+n-1, as the seed's n-step dataset), ``trajectory`` (whole
episodes). Peers: replaybuf (any backend), memmap-replay-buffer 0.2.3 (the seed), TorchRL's
LazyMemmapStorage and CompressedListStorage, and a plain np.memmap fancy-index gather of the
seed's files.
"""

from __future__ import annotations

import importlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.workload import FIELD_NAMES, FIELDS, WorkloadSize

NSTEP = 5
CURRENT_FIELDS = ("frame", "state")
SEQUENCE_FIELDS = ("action", "reward", "done")
KINDS = ("timestep", "nstep", "trajectory")
# CompressedListStorage's level (its default, 3)
ZSTD_LEVEL = 3


class Unavailable(Exception):
    """A peer that cannot run here; the message says why and is printed instead of figures."""


def import_buffer_class(module: str) -> type:
    """``ReplayBuffer`` from ``module``, or Unavailable naming the reason."""
    try:
        return importlib.import_module(module).ReplayBuffer
    except (ImportError, AttributeError) as error:
        raise Unavailable(f"{module}.ReplayBuffer not importable: {error}") from error


def read_folder(folder: Path) -> int:
    """Read every file under ``folder`` once (warms the OS page cache); return the bytes read."""
    total = 0
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                while block := handle.read(1 << 24):
                    total += len(block)
    return total


def folder_bytes(folder: Path) -> int:
    """Bytes stored under ``folder``."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


class SeedApiPeer:
    """A buffer with the seed's API: memmap-replay-buffer itself, or replaybuf with a backend."""

    def __init__(
        self, name: str, module: str, size: WorkloadSize, workdir: Path, fields: dict | None = None, **options: Any
    ) -> None:
        self.name = name
        self.buffer_class = import_buffer_class(module)
        self.size = size
        self.folder = Path(tempfile.mkdtemp(prefix=f"{name.replace(' ', '_').replace('=', '')}-", dir=workdir))
        self.fields = dict(FIELDS) if fields is None else fields
        self.options = options
        self.buffer = None

    def open(self, flush_every_store_step: int = 1) -> Any:
        """A fresh, empty buffer over this peer's folder."""
        self.buffer = self.buffer_class(
            str(self.folder / "buffer"),
            max_episodes=self.size.episodes,
            max_timesteps=self.size.steps,
            fields=self.fields,
            overwrite=True,
            flush_every_store_step=flush_every_store_step,
            **self.options,
        )
        return self.buffer

    def store_steps(self, episodes: list[dict[str, np.ndarray]]) -> None:
        """Collection as an agent does it: one ``store()`` per step inside ``one_episode()``."""
        buffer = self.buffer
        for episode in episodes:
            with buffer.one_episode():
                for step in range(len(episode["done"])):
                    buffer.store(**{name: episode[name][step] for name in FIELD_NAMES})

    def store_episodes(self, episodes: list[dict[str, np.ndarray]]) -> None:
        """Whole-episode writes with ``store_episode()``."""
        for episode in episodes:
            self.buffer.store_episode(**episode)

    def fill_episode(self, episode: dict[str, np.ndarray]) -> None:
        """Append one episode for the sampling benchmark (opens the buffer on the first call)."""
        if self.buffer is None:
            self.open(flush_every_store_step=0)
        self.buffer.store_episode(**episode)

    def finish_fill(self) -> None:
        self.buffer.flush()

    def loader(self, kind: str, batch_size: int, num_workers: int) -> DataLoader:
        return seed_api_loader(self.buffer, kind, batch_size, num_workers)

    def folders(self) -> list[Path]:
        return [self.folder]

    def close(self) -> None:
        self.buffer = None
        shutil.rmtree(self.folder, ignore_errors=True)


def seed_api_loader(buffer: Any, kind: str, batch_size: int, num_workers: int) -> DataLoader:
    """A shuffled DataLoader of ``kind`` batches from a buffer with the seed's API (writer or reader)."""
    common = dict(batch_size=batch_size, shuffle=True, drop_last=True, **worker_options(num_workers))
    if kind == "timestep":
        return buffer.dataloader(timestep_level=True, **common)
    if kind == "nstep":
        return buffer.dataloader(
            n_steps=NSTEP,
            current_fields=CURRENT_FIELDS,
            next_fields=CURRENT_FIELDS,
            sequence_fields=SEQUENCE_FIELDS,
            **common,
        )
    return buffer.dataloader(**common)


def seed_peer(size: WorkloadSize, workdir: Path) -> SeedApiPeer:
    return SeedApiPeer("seed", "memmap_replay_buffer", size, workdir)


def replaybuf_peer(
    size: WorkloadSize, workdir: Path, backend: str, frame_chunk: int | None = None, frame_compressor: str | None = None
) -> SeedApiPeer:
    """replaybuf on ``backend``; the frame_* arguments override the frame field's time chunk
    (steps) or compressor (e.g. 'none', 'blosc-lz4', 'zstd:1') through its field spec."""
    fields = dict(FIELDS)
    name = f"replaybuf {backend}"
    if frame_chunk is not None or frame_compressor is not None:
        dtype, shape = FIELDS["frame"]
        spec = {"dtype": dtype, "shape": shape}
        if frame_chunk is not None:
            spec["chunks"] = frame_chunk
            name += f" frame-chunk={frame_chunk}"
        if frame_compressor is not None:
            spec["compressor"] = frame_compressor
            name += f" frame-codec={frame_compressor}"
        fields["frame"] = spec
    return SeedApiPeer(name, "replaybuf", size, workdir, fields=fields, backend=backend)


def replaybuf_peers(
    size: WorkloadSize,
    workdir: Path,
    backends: list[str],
    frame_chunks: list[int],
    frame_compressors: list[str],
    notes: list[str],
) -> list[SeedApiPeer]:
    """One replaybuf peer per backend (its defaults), plus zarr variants per frame chunk / compressor."""
    peers = []
    variants = [(backend, None, None) for backend in backends]
    variants += [("zarr", chunk, None) for chunk in frame_chunks]
    variants += [("zarr", None, compressor) for compressor in frame_compressors]
    for backend, chunk, compressor in variants:
        try:
            peers.append(replaybuf_peer(size, workdir, backend, chunk, compressor))
        except Unavailable as reason:
            notes.append(f"replaybuf {backend}: skipped, {reason}")
    return peers


def worker_options(num_workers: int) -> dict[str, Any]:
    """DataLoader worker keywords. Workers fork explicitly: importing torchrl switches the global
    start method to spawn, and the seed's datasets cannot be pickled for spawn."""
    if num_workers == 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "persistent_workers": True, "multiprocessing_context": "fork"}


def identity(batch: Any) -> Any:
    """collate_fn for datasets whose ``__getitems__`` already returns a whole batch."""
    return batch


class MemmapGatherDataset(Dataset):
    """The lower bound: numpy fancy-index gathers on np.memmap views of the seed's .npy files.

    Opens the files lazily, so it pickles to DataLoader workers without open maps.
    """

    def __init__(self, folder: Path, kind: str, episodes: int, steps: int) -> None:
        self.folder, self.kind, self.episodes, self.steps = folder, kind, episodes, steps
        self.arrays: dict[str, np.ndarray] | None = None
        # Valid starts as the seed defines them: every step for timesteps, t <= len-2 for n-step.
        last = steps if kind == "timestep" else steps - 1
        self.starts = np.arange(episodes * last)
        self.last = last

    def __len__(self) -> int:
        return self.episodes if self.kind == "trajectory" else len(self.starts)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "arrays": None}

    def _open(self) -> dict[str, np.ndarray]:
        if self.arrays is None:
            self.arrays = {name: np.load(self.folder / f"{name}.data.npy", mmap_mode="r") for name in FIELD_NAMES}
        return self.arrays

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        arrays = self._open()
        indices = np.asarray(indices)
        if self.kind == "trajectory":
            order = np.sort(indices)
            return {name: torch.from_numpy(arrays[name][order]) for name in FIELD_NAMES}
        episode, step = np.divmod(indices, self.last)
        if self.kind == "timestep":
            return {name: torch.from_numpy(arrays[name][episode, step]) for name in FIELD_NAMES}
        actual = np.minimum(NSTEP, self.steps - step - 1)
        batch = {name: torch.from_numpy(arrays[name][episode, step]) for name in CURRENT_FIELDS}
        batch |= {f"next_{name}": torch.from_numpy(arrays[name][episode, step + actual]) for name in CURRENT_FIELDS}
        window = step[:, None] + np.arange(NSTEP)[None]
        valid = np.arange(NSTEP)[None] < actual[:, None]
        for name in SEQUENCE_FIELDS:
            values = arrays[name][episode[:, None], np.minimum(window, self.steps - 1)]
            values[~valid] = 0
            batch[f"seq_{name}"] = torch.from_numpy(values)
        batch["n_step_lens"] = torch.from_numpy(actual)
        return batch


class MemmapGatherPeer:
    """np.memmap gather over a seed buffer's files (fill the seed peer first)."""

    name = "np.memmap gather"

    def __init__(self, folder: Path, size: WorkloadSize) -> None:
        """``folder``: a seed buffer's folder (its ``<field>.data.npy`` files)."""
        self.folder = Path(folder)
        self.size = size

    def loader(self, kind: str, batch_size: int, num_workers: int) -> DataLoader:
        dataset = MemmapGatherDataset(self.folder, kind, self.size.episodes, self.size.steps)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            drop_last=True,
            collate_fn=identity,
            **worker_options(num_workers),
        )

    def folders(self) -> list[Path]:
        return [self.folder]

    def close(self) -> None:
        """Nothing to remove: the files belong to the seed peer."""


def torchrl_loader(storage: Any, kind: str, batch_size: int, steps: int, prefetch: int | None = None) -> Iterator[Any]:
    """Batches of ``kind`` from a TorchRL ``storage`` through its own ReplayBuffer and samplers:
    RandomSampler for timesteps, SliceSampler (on the ``episode`` key) of n+1 steps for n-step
    and of ``steps`` steps for trajectories."""
    import torchrl.data

    if kind == "timestep":
        sampler, total = torchrl.data.RandomSampler(), batch_size
    else:
        slice_len = NSTEP + 1 if kind == "nstep" else steps
        sampler = torchrl.data.SliceSampler(slice_len=slice_len, traj_key="episode", strict_length=False)
        total = batch_size * slice_len
    return iter(torchrl.data.ReplayBuffer(storage=storage, sampler=sampler, batch_size=total, prefetch=prefetch))


def _zstd_codec() -> Any:
    import numcodecs

    return numcodecs.Zstd(level=ZSTD_LEVEL)


def zstd_compress(tensor: torch.Tensor) -> torch.Tensor:
    """CompressedListStorage's compression_fn: zstd (numcodecs) of the tensor's bytes."""
    return torch.frombuffer(bytearray(_zstd_codec().encode(tensor.contiguous().numpy())), dtype=torch.uint8)


def zstd_decompress(compressed: torch.Tensor, metadata: dict) -> torch.Tensor:
    """CompressedListStorage's decompression_fn: the inverse of ``zstd_compress``."""
    raw = _zstd_codec().decode(compressed.numpy())
    return torch.frombuffer(bytearray(raw), dtype=metadata["dtype"]).reshape(metadata["shape"])


class TorchRLPeer:
    """TorchRL's LazyMemmapStorage (or, ``compressed=True``, CompressedListStorage) with its own
    ReplayBuffer and samplers (``torchrl_loader``).

    timestep: RandomSampler, batch 256; nstep: SliceSampler of n+1 consecutive steps
    (it returns every field at all n+1 steps, so it moves more bytes than the others);
    trajectory: SliceSampler of whole episodes. "workers" become ``prefetch`` threads,
    TorchRL's own way to sample in the background.

    CompressedListStorage keeps every step's fields compressed in RAM, one item per step. Its
    default codec is zstd only on Python >= 3.14 (zlib before), so it is given zstd-3 functions
    (``zstd_compress``) here; SliceSampler cannot read its episode keys (it needs a TensorDict
    out of the storage), so n-step and trajectory batches fail on it.
    """

    def __init__(self, size: WorkloadSize, workdir: Path, compressed: bool = False) -> None:
        try:
            import tensordict
            import torchrl.data
        except ImportError as error:
            raise Unavailable(f"torchrl/tensordict not importable: {error}") from error
        logging.getLogger("torchrl").setLevel(logging.WARNING)  # its import installs an INFO handler
        self.tensordict, self.data = tensordict, torchrl.data
        self.size = size
        self.name = "TorchRL compressed" if compressed else "TorchRL"
        self.folder = Path(tempfile.mkdtemp(prefix="torchrl-", dir=workdir))
        if compressed:
            self.storage = self.data.CompressedListStorage(
                size.total_steps, compression_fn=zstd_compress, decompression_fn=zstd_decompress
            )
        else:
            self.storage = self.data.LazyMemmapStorage(size.total_steps, scratch_dir=str(self.folder), existsok=True)
        self.writer_buffer = self.data.ReplayBuffer(storage=self.storage)
        self.episodes_filled = 0

    def fill_episode(self, episode: dict[str, np.ndarray]) -> None:
        """Append one episode, tagged with its index for SliceSampler."""
        steps = len(episode["done"])
        fields = {name: torch.from_numpy(np.ascontiguousarray(episode[name])) for name in FIELD_NAMES}
        fields["episode"] = torch.full((steps,), self.episodes_filled, dtype=torch.int64)
        self.writer_buffer.extend(self.tensordict.TensorDict(fields, batch_size=[steps]))
        self.episodes_filled += 1

    def finish_fill(self) -> None:
        """Nothing to do: the storage is a set of memmaps (or a list in RAM) already."""

    def loader(self, kind: str, batch_size: int, num_workers: int) -> Iterator[Any]:
        return torchrl_loader(self.storage, kind, batch_size, self.size.steps, num_workers or None)

    def folders(self) -> list[Path]:
        return [self.folder]

    def close(self) -> None:
        self.writer_buffer = self.storage = None
        shutil.rmtree(self.folder, ignore_errors=True)
