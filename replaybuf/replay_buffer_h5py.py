"""``memmap_replay_buffer.replay_buffer_h5py``'s public class under the same module name (see
``replaybuf.replay_buffer``)."""

from .h5py_buffer import ReplayBufferH5PY

__all__ = ["ReplayBufferH5PY"]
