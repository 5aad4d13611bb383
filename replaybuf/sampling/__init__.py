"""Reading a buffer back: datasets, DataLoaders and prioritized sampling."""

from ..storage import chunk_cache
from .collate import CollatedSamples, Collator
from .datasets import (
    ReplayDataset,
    ReplayDatasetNStep,
    ReplayDatasetTimestep,
    ReplayDatasetTimeWindow,
    ReplayDatasetTrajectory,
    SnapshotOverwrittenError,
)
from .loader import make_dataloader, make_dataset
from .prioritized import PrioritizedBatchSampler, update_priorities
from .ratelimit import RateLimitedLoader, RateLimiter, RateLimitTimeout

__all__ = [
    "ReplayDataset",
    "ReplayDatasetTrajectory",
    "ReplayDatasetTimestep",
    "ReplayDatasetNStep",
    "ReplayDatasetTimeWindow",
    "SnapshotOverwrittenError",
    "make_dataset",
    "make_dataloader",
    "update_priorities",
    "PrioritizedBatchSampler",
    "Collator",
    "CollatedSamples",
    "chunk_cache",
    "RateLimiter",
    "RateLimitedLoader",
    "RateLimitTimeout",
]
