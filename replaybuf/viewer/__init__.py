"""Local web viewer: synced videos with frame stepping (``--serve``) and a buffer browser (``view``).

Everything the pages need is served from ``static/`` by a loopback-only server; nothing is
fetched from the network.
"""

from replaybuf.viewer.apps import BufferApp, ReplayApp
from replaybuf.viewer.server import ViewerServer

__all__ = ["BufferApp", "ReplayApp", "ViewerServer"]
