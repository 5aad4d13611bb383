"""A moto S3 server on 127.0.0.1 for the viewer and CLI tests (no other network traffic)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def moto_s3(bucket: str = "demos") -> Iterator[dict]:
    """storage_options for s3:// URLs served by a fresh moto server holding an empty ``bucket``."""
    pytest.importorskip("s3fs", reason="remote buffers need replaybuf[s3]")
    from moto.server import ThreadedMotoServer

    environment = pytest.MonkeyPatch()
    environment.setenv("AWS_EC2_METADATA_DISABLED", "true")
    environment.setenv("AWS_ACCESS_KEY_ID", "testing")
    environment.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    environment.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
    import s3fs

    # moto keeps its buckets per process, not per server: a module after another finds it there
    s3fs.S3FileSystem(**options, skip_instance_cache=True).makedirs(bucket, exist_ok=True)
    try:
        yield options
    finally:
        server.stop()
        environment.undo()
