"""A torch Dataset over a zarr array on S3, importable cheaply by spawned DataLoader workers."""

from __future__ import annotations

import os

import torch
import zarr

from replaybuf.storage._remote import ProcessLocalStore


class RemoteRows(torch.utils.data.Dataset):
    """Rows of a zarr array on S3; records which process and client served each."""

    def __init__(self, url: str, storage_options: dict):
        self.array = zarr.open_array(ProcessLocalStore(url, storage_options, read_only=True), path="data/obs", mode="r")

    def __len__(self) -> int:
        return self.array.shape[0]

    def __getitem__(self, index: int):
        store = self.array.store_path.store
        return torch.from_numpy(self.array[index]), os.getpid(), store.backend
