"""gcp-storage-emulator as the GCS tests run it: ``python tests/_gcs_emulator.py start ...``.

Two changes to the emulator, both to how it serves, none to what it stores:

- a listen backlog of 128: http.server's 5 drops the connections of a burst of concurrent
  requests, which the client retries after 1 s;
- multipart uploads split at their boundaries byte for byte. The emulator parses them with the
  ``email`` package, which takes a lone ``\\r`` for a line end: an object whose last byte is
  0x0d lost it (gcsfs frames its parts with ``\\n``, so ``data + \\n--boundary`` read as the
  line ``data[:-1]`` ended by ``\\r\\n``), and a meta chunk ending in that byte read back as
  damaged. GCS keeps every byte.

And one to what it accepts: an upload with ``ifGenerationMatch=0`` (create only if absent, the
writer lease's ``create``) of an object that exists is refused with 412, as GCS refuses it; the
emulator ignored the condition, so a second writer's lease replaced the first's.
"""

from __future__ import annotations

import json
import re
import socketserver
import sys
from http import HTTPStatus

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

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


_insert = objects.insert


def _insert_if_absent(request, response, storage, *args, **kwargs):
    """The emulator's ``objects.insert``, an ``ifGenerationMatch=0`` upload of an object that
    exists refused with 412 (conditionNotMet) as GCS refuses it."""
    if request.query.get("ifGenerationMatch") == ["0"]:
        name = request.query.get("name", [None])[0]
        if name is None and isinstance(request.data, dict):
            name = request.data.get("meta", {}).get("name")
        try:
            storage.get_file_obj(request.params["bucket_name"], name)
        except NotFound:
            pass
        else:
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "conditionNotMet"}})
            return None
    return _insert(request, response, storage, *args, **kwargs)


if __name__ == "__main__":
    socketserver.TCPServer.request_queue_size = 128
    server._read_data = _read_data
    objects.insert = _insert_if_absent
    for _, handlers in server.HANDLERS:
        for method, handler in handlers.items():
            if handler is _insert:
                handlers[method] = _insert_if_absent
    main(sys.argv[1:])
