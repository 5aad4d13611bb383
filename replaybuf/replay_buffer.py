"""``memmap_replay_buffer.replay_buffer``'s public classes under the same module name, so
``from memmap_replay_buffer.replay_buffer import ReplayBuffer`` works after changing the
package name alone. Each is the object ``replaybuf`` exports; ``ReplayBufferBase``, the seed's
base class of its memmap and HDF5 buffers (type hints, ``isinstance``), is ``ReplayBuffer``,
the base class of both here."""

from .buffer import ReplayBuffer
from .sampling import (
    ReplayDataset,
    ReplayDatasetNStep,
    ReplayDatasetTimestep,
    ReplayDatasetTimeWindow,
    ReplayDatasetTrajectory,
)

ReplayBufferBase = ReplayBuffer

__all__ = [
    "ReplayBuffer",
    "ReplayBufferBase",
    "ReplayDataset",
    "ReplayDatasetNStep",
    "ReplayDatasetTimeWindow",
    "ReplayDatasetTimestep",
    "ReplayDatasetTrajectory",
]
