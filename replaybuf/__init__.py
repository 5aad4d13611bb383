"""replaybuf: an episode store for reinforcement and robot learning.

The loaders, the collector and ``ConcatReplayBuffer`` need torch (and dask); they are imported
on first use, so ``import replaybuf`` and the command line start without loading torch.
"""

from ._lazy import lazy_attributes
from .actors import discover_shards, open_shard
from .buffer import ReplayBuffer
from .consistency import ConcurrentWriteError, read_episodes_consistent
from .h5py_buffer import ReplayBufferH5PY, copy_seed_h5
from .maintenance import WriterOutpacedError, convert, info, verify
from .metasums import MetaChecksumError
from .schema import Field, Schema, UnknownFieldError
from .snapshots import SnapshotError, SnapshotHeldError
from .storage import (
    BufferDamagedError,
    BufferLockedError,
    BufferNotFoundError,
    BufferReplacedError,
    ChecksumEntryError,
    ChunkChecksumError,
    CorruptChunkError,
    EpisodeLengthError,
    ForeignEntriesError,
    GenerationMismatchError,
    LostLengthError,
    NewerFormatError,
    StalePlanError,
    Storage,
    StorageError,
    UnfinishedCreateError,
    UnfinishedEditError,
    make_storage,
)
from .video import frames_to_sheet, trajectory_to_video

_LAZY = {
    "EpisodeCollector": ".collector",
    "ConcatReplayBuffer": ".concat",
    "ReplayDataset": ".sampling",
    "ReplayDatasetNStep": ".sampling",
    "ReplayDatasetTimestep": ".sampling",
    "ReplayDatasetTimeWindow": ".sampling",
    "ReplayDatasetTrajectory": ".sampling",
    "SnapshotOverwrittenError": ".sampling",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ReplayBuffer",
    "EpisodeCollector",
    "ConcatReplayBuffer",
    "Field",
    "Schema",
    "Storage",
    "StorageError",
    "BufferNotFoundError",
    "UnfinishedCreateError",
    "UnfinishedEditError",
    "ForeignEntriesError",
    "BufferDamagedError",
    "NewerFormatError",
    "BufferLockedError",
    "ChecksumEntryError",
    "ChunkChecksumError",
    "CorruptChunkError",
    "EpisodeLengthError",
    "LostLengthError",
    "MetaChecksumError",
    "UnknownFieldError",
    "make_storage",
    "frames_to_sheet",
    "trajectory_to_video",
    "ReplayBufferH5PY",
    "copy_seed_h5",
    "convert",
    "info",
    "verify",
    "ReplayDataset",
    "ReplayDatasetNStep",
    "ReplayDatasetTimestep",
    "ReplayDatasetTimeWindow",
    "ReplayDatasetTrajectory",
    "discover_shards",
    "open_shard",
    "read_episodes_consistent",
    "ConcurrentWriteError",
    "StalePlanError",
    "BufferReplacedError",
    "SnapshotError",
    "SnapshotHeldError",
    "SnapshotOverwrittenError",
    "GenerationMismatchError",
    "WriterOutpacedError",
]
__version__ = "0.1.0"
