"""gcp-storage-emulator as the GCS tests run it: ``python tests/_gcs_emulator.py start ...``.

Two changes to the emulator, both to how it serves, none to what it stores:

- a listen backlog of 128: http.server's 5 drops the connections of a burst of concurrent
  requests, which the client retries after 1 s;
- multipart uploads split at their boundaries byte for byte. The emulator parses them with the
  ``email`` package, which takes a lone ``\\r`` for a line end: an object whose last byte is
  0x0d lost it (gcsfs frames its parts with ``\\n``, so ``data + \\n--boundary`` read as the
  line ``data[:-1]`` ended by ``\\r\\n``), and a meta chunk ending in that byte read back as
  damaged. GCS keeps every byte.
"""

from __future__ import annotations

import json
import re
import socketserver
import sys

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main

_BOUNDARY = re.compile(r'boundary="?([^";]+)"?')
_parsed = server._read_data


def _read_data(request_handler, query):
    """The emulator's ``_read_data``, a ``multipart/related`` upload split byte for byte."""
    content_type = request_handler.headers.get("Content-Type") or ""
    found = _BOUNDARY.search(content_type)
    if not content_type.startswith("multipart/related") or found is None:
        return _parsed(request_handler, query)
    raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
    delimiter = b"--" + found.group(1).encode()
    line_end = b"\r\n" if raw.startswith(delimiter + b"\r\n") else b"\n"
    parts = raw.split(line_end + delimiter)  # each part but the first ends where its delimiter's line starts
    meta, content = (part.split(line_end + line_end, 1) for part in parts[:2])
    kind = re.search(rb"(?im)^content-type:\s*([^\r\n;]+)", content[0])
    return {
        "meta": json.loads(meta[1]),
        "content": content[1],
        "content-type": kind.group(1).decode().strip() if kind else "application/octet-stream",
    }


if __name__ == "__main__":
    socketserver.TCPServer.request_queue_size = 128
    server._read_data = _read_data
    main(sys.argv[1:])
