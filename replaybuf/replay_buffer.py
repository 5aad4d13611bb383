"""``memmap_replay_buffer.replay_buffer``'s public classes under the same module name, so
``from memmap_replay_buffer.replay_buffer import ReplayBuffer`` works after changing the
package name alone. Each is the object ``replaybuf`` exports."""

from .buffer import ReplayBuffer
from .sampling import (
    ReplayDataset,
    ReplayDatasetNStep,
    ReplayDatasetTimestep,
    ReplayDatasetTimeWindow,
    ReplayDatasetTrajectory,
)

__all__ = [
    "ReplayBuffer",
    "ReplayDataset",
    "ReplayDatasetNStep",
    "ReplayDatasetTimeWindow",
    "ReplayDatasetTimestep",
    "ReplayDatasetTrajectory",
]
