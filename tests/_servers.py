"""Real object-storage servers on 127.0.0.1 for the tests: moto's S3 API and gcp-storage-emulator.

Load the fixtures explicitly in a test module::

    pytest_plugins = ["tests._servers"]

Both servers bind 127.0.0.1 on a free port, live for the test session, and record every request
they answer (method and path), so a test can check, e.g., that a read-only open wrote nothing::

    with s3_server.record() as requests:
        ...
    assert requests.writes() == []
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from moto.server import ThreadedMotoServer
from werkzeug.serving import WSGIRequestHandler, make_server

WRITE_METHODS = frozenset({"PUT", "POST", "DELETE", "PATCH"})
_LOG_LINE = re.compile(r'^"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RequestLog:
    """The (method, path) pairs a server answered while a `record()` block ran, and (S3) the
    most requests of each method it was answering at once (``peak_in_flight``)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.peak_in_flight: Counter[str] = Counter()

    def count(self, *methods: str) -> int:
        """Number of requests with any of ``methods`` (all requests when none given)."""
        return sum(1 for method, _ in self.requests if not methods or method in methods)

    def by_method(self) -> Counter[str]:
        return Counter(method for method, _ in self.requests)

    def writes(self) -> list[tuple[str, str]]:
        """Requests that can change stored state (PUT, POST, DELETE, PATCH)."""
        return [(method, path) for method, path in self.requests if method in WRITE_METHODS]


class _Recorder:
    """Fan-out of incoming requests to the `RequestLog`s of the open `record()` blocks.

    ``settle`` (for servers whose log arrives late) waits until every request answered so far has
    been seen; it runs on entry and on exit, so a block gets exactly the requests made inside it.
    """

    def __init__(self) -> None:
        self._logs: list[RequestLog] = []
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()

    def add(self, method: str, path: str) -> None:
        with self._lock:
            for log in self._logs:
                log.requests.append((method, path))

    @contextlib.contextmanager
    def answering(self, method: str) -> Iterator[None]:
        """Count a request of ``method`` as in flight while the block runs."""
        with self._lock:
            self._in_flight[method] += 1
            for log in self._logs:
                log.peak_in_flight[method] = max(log.peak_in_flight[method], self._in_flight[method])
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[method] -= 1

    @contextlib.contextmanager
    def record(self, settle: Any = None) -> Iterator[RequestLog]:
        log = RequestLog()
        if settle is not None:
            settle()
        with self._lock:
            self._logs.append(log)
        try:
            yield log
        finally:
            if settle is not None:
                settle()
            with self._lock:
                self._logs.remove(log)


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        pass


class S3TestServer(ThreadedMotoServer):
    """moto's S3 API in this process, restartable on the same port with its objects intact.

    moto keeps its state in module-level backends, so stopping the HTTP server and starting a
    new one on the same port (`stop` / `start`) loses nothing: a model of a server outage.
    ``latency`` (seconds) delays every request, a stand-in for a network round trip in benchmarks.
    """

    access_key = "testing-key"
    secret_key = "testing-secret"

    def __init__(self, bucket: str = "replaybuf-test", latency: float = 0.0) -> None:
        super().__init__(ip_address="127.0.0.1", port=free_port(), verbose=False)
        self.bucket = bucket
        self.latency = latency
        self.endpoint_url = f"http://127.0.0.1:{self._port}"
        self._recorder = _Recorder()

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs-style options for `open_store` (credentials are moto's dummies)."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def url(self, path: str = "") -> str:
        return f"s3://{self.bucket}/{path.strip('/')}"

    def record(self) -> contextlib.AbstractContextManager[RequestLog]:
        return self._recorder.record()

    @property
    def running(self) -> bool:
        return self._server is not None

    def _server_entry(self) -> None:
        dispatcher = DomainDispatcherApplication(create_backend_app)

        def app(environ: dict[str, Any], start_response: Any) -> Any:
            self._recorder.add(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""))
            with self._recorder.answering(environ["REQUEST_METHOD"]):
                if self.latency:
                    time.sleep(self.latency)
                return dispatcher(environ, start_response)

        self._server = make_server(self._ip_address, self._port, app, threaded=True, request_handler=_QuietHandler)
        self._server_ready_event.set()
        self._server.serve_forever(poll_interval=0.05)

    def stop(self) -> None:
        """Stop answering and close the listening socket (clients get 'connection refused')."""
        if self._server is None:
            return
        server, self._server = self._server, None
        self._server_ready_event.clear()
        server.shutdown()
        server.server_close()
        self._thread.join()

    def create_bucket(self) -> None:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=self.bucket)


class GCSTestServer:
    """gcp-storage-emulator in a subprocess (in-memory), its request log read from its stderr."""

    def __init__(self, bucket: str = "replaybuf-test") -> None:
        self.bucket = bucket
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._recorder = _Recorder()
        self._seen_markers: set[str] = set()
        self._marker_seen = threading.Condition()
        self._process: subprocess.Popen[str] | None = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """gcsfs options for `open_store`: the emulator needs no credentials."""
        return {"endpoint_url": self.endpoint_url, "token": "anon"}

    def url(self, path: str = "") -> str:
        return f"gs://{self.bucket}/{path.strip('/')}"

    @property
    def pid(self) -> int | None:
        """The emulator's process id (for CPU accounting in benchmarks)."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        # the emulator with a listen backlog for bursts and multipart uploads read byte for byte
        self._process = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("_gcs_emulator.py")),
                "start",
                "--host=127.0.0.1",
                f"--port={self.port}",
                "--in-memory",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._read_log, daemon=True).start()
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint_url}/storage/v1/b", timeout=1).close()
                return
            except (urllib.error.URLError, ConnectionError):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"gcp-storage-emulator did not start on {self.endpoint_url}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def create_bucket(self) -> None:
        request = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project=replaybuf-test",
            data=json.dumps({"name": self.bucket}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=10).close()

    def record(self) -> contextlib.AbstractContextManager[RequestLog]:
        return self._recorder.record(settle=self._settle)

    def _read_log(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        for line in self._process.stderr:
            match = _LOG_LINE.match(line.strip())
            if match is None:
                continue
            method, path = match.group(1), match.group(2)
            if path.startswith("/__replaybuf_marker__/"):
                with self._marker_seen:
                    self._seen_markers.add(path)
                    self._marker_seen.notify_all()
            else:
                self._recorder.add(method, path)

    def _settle(self) -> None:
        """Wait until the log reader has seen every request answered so far (a marker request)."""
        marker = f"/__replaybuf_marker__/{uuid.uuid4().hex}"
        with contextlib.suppress(urllib.error.HTTPError):
            urllib.request.urlopen(self.endpoint_url + marker, timeout=10).close()
        with self._marker_seen:
            if not self._marker_seen.wait_for(lambda: marker in self._seen_markers, timeout=10):
                raise RuntimeError("gcp-storage-emulator's request log stopped")


class S3Outage:
    """Stop and restart the session's S3 server inside one test; it runs again afterwards."""

    def __init__(self, server: S3TestServer) -> None:
        self.server = server

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        if not self.server.running:
            self.server.start()


def _serving(server):
    """Start ``server``, give it an empty bucket, yield it, and stop it."""
    server.start()
    try:
        server.create_bucket()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3TestServer]:
    """moto S3 on 127.0.0.1 with an empty bucket, for the whole session."""
    yield from _serving(S3TestServer())


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSTestServer]:
    """gcp-storage-emulator on 127.0.0.1 with an empty bucket, for the whole session."""
    previous = os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    try:
        yield from _serving(GCSTestServer())
    finally:
        if previous is None:
            os.environ.pop("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", None)
        else:
            os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = previous


@pytest.fixture
def s3_outage(s3_server: S3TestServer) -> Iterator[S3Outage]:
    """Lets a test stop the S3 server (connections refused) and restart it with its data kept."""
    outage = S3Outage(s3_server)
    try:
        yield outage
    finally:
        outage.restart()
