"""replaybuf: an episode store for reinforcement and robot learning."""

from .buffer import ReplayBuffer
from .collector import EpisodeCollector
from .concat import ConcatReplayBuffer
from .consistency import read_episodes_consistent
from .h5py_buffer import ReplayBufferH5PY
from .sampling import (
    ReplayDataset,
    ReplayDatasetNStep,
    ReplayDatasetTimestep,
    ReplayDatasetTimeWindow,
    ReplayDatasetTrajectory,
)
from .schema import Field, Schema
from .shards import discover_shards, open_shard
from .storage.base import BufferNotFoundError, Storage, StorageError, make_storage
from .tools import convert, info, verify
from .video import frames_to_sheet, trajectory_to_video

__all__ = ["ReplayBuffer", "EpisodeCollector", "ConcatReplayBuffer", "Field", "Schema", "Storage", "StorageError", "BufferNotFoundError", "make_storage",
           "frames_to_sheet", "trajectory_to_video", "ReplayBufferH5PY", "convert", "info", "verify",
           "ReplayDataset", "ReplayDatasetNStep", "ReplayDatasetTimestep", "ReplayDatasetTimeWindow",
           "ReplayDatasetTrajectory", "discover_shards", "open_shard", "read_episodes_consistent"]
__version__ = "0.1.0"
