"""``memmap_replay_buffer.episode_collector``'s public class under the same module name (see
``replaybuf.replay_buffer``)."""

from .collector import EpisodeCollector

__all__ = ["EpisodeCollector"]
