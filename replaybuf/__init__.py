"""replaybuf: an episode store for reinforcement and robot learning."""

from .buffer import ReplayBuffer
from .collector import EpisodeCollector
from .h5py_buffer import ReplayBufferH5PY
from .schema import Field, Schema
from .storage.base import BufferNotFoundError, Storage, StorageError, make_storage
from .tools import convert, info, verify
from .video import frames_to_sheet, trajectory_to_video

__all__ = ["ReplayBuffer", "EpisodeCollector", "Field", "Schema", "Storage", "StorageError", "BufferNotFoundError", "make_storage",
           "frames_to_sheet", "trajectory_to_video", "ReplayBufferH5PY", "convert", "info", "verify"]
__version__ = "0.1.0"
