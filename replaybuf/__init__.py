"""replaybuf: an episode store for reinforcement and robot learning."""

from .buffer import ReplayBuffer
from .collector import EpisodeCollector
from .schema import Field, Schema
from .storage.base import BufferNotFoundError, Storage, StorageError, make_storage

__all__ = ["ReplayBuffer", "EpisodeCollector", "Field", "Schema", "Storage", "StorageError", "BufferNotFoundError", "make_storage"]
__version__ = "0.1.0"
