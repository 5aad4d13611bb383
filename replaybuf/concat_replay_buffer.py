"""``memmap_replay_buffer.concat_replay_buffer``'s public class under the same module name (see
``replaybuf.replay_buffer``)."""

from .concat import ConcatReplayBuffer

__all__ = ["ConcatReplayBuffer"]
