"""A loopback-only HTTP server for the viewer pages, their JSON API and the videos.

The server knows nothing about buffers: an *app* object answers ``/api/...`` and
``/video/...`` paths with a ``JsonResponse`` or a ``FileResponse``, and names the static page
served at ``/``. Files are sent with HTTP range support so that ``<video>`` elements can
seek. Only 127.0.0.1 is ever bound, requests naming another host are refused (DNS
rebinding), and a page of another origin may open the viewer but not fetch or embed what it
serves (``Sec-Fetch-Site``, ``Origin``, ``Cross-Origin-Resource-Policy``; no CORS header is ever
sent) nor frame it, so a page elsewhere on the web can neither read the buffer through the viewer
nor start renders. The pages run only the viewer's own scripts (``Content-Security-Policy``).
"""

from __future__ import annotations

import json
import mimetypes
import shutil
import signal
import sys
import threading
import webbrowser
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

__all__ = ["FileResponse", "JsonResponse", "NotFound", "ViewerApp", "ViewerServer", "parse_range"]

HOST = "127.0.0.1"
PAGES = ("/", "/index.html")  # where the app's page is served
STATIC_DIR = Path(__file__).parent / "static"
COPY_CHUNK = 1 << 20
POLL_INTERVAL = 0.05  # seconds between shutdown checks of a background server
IDLE_TIMEOUT = 60  # seconds a connection may wait on a socket before it is closed
# Sec-Fetch-Site values of requests another origin's page made; only its navigations are served
FOREIGN_SITES = ("cross-site", "same-site")
# what the pages may load and who may frame them: their own scripts, styles, videos and API, no
# inline script (markup that slipped into a page could not run), no frame on another page
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; media-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
CONTENT_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".html": "text/html",
    ".mp4": "video/mp4",
    ".webm": "video/webm",
    ".gif": "image/gif",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}


@dataclass(frozen=True)
class JsonResponse:
    """A JSON body; ``body`` must hold only JSON-native values (no NaN)."""

    body: Any
    status: int = HTTPStatus.OK


@dataclass(frozen=True)
class FileResponse:
    """A file on disk, sent whole or by byte range; ``release`` (if any) is called once the
    answer is sent or failed (a cache unpins the file it kept from deletion meanwhile)."""

    path: Path
    release: Callable[[], None] | None = None


class NotFound(LookupError):
    """Raised by an app for a path it does not serve (answered with 404)."""


class ViewerApp(Protocol):
    """What the server asks of the app it serves."""

    page: str  # the file in static/ served at "/"

    def respond(self, path: str) -> JsonResponse | FileResponse:
        """Answer an ``/api/...`` or ``/video/...`` path (already URL-decoded)."""
        ...

    def close(self) -> None:
        """Release what the app holds (temp files); called when the server stops."""
        ...


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The first byte range of a ``Range`` header as inclusive (start, end), None for the whole file.

    Raises ValueError for a range that cannot be satisfied (answered with 416).
    """
    if not header:
        return None
    unit, _, ranges = header.partition("=")
    if unit.strip() != "bytes" or not ranges:
        return None
    start_text, dash, end_text = ranges.split(",")[0].strip().partition("-")
    if not dash:
        raise ValueError(f"malformed range {header!r}")
    try:
        if not start_text:
            length = int(end_text)
            if length <= 0:
                raise ValueError(f"empty suffix range {header!r}")
            return max(size - length, 0), size - 1
        start = int(start_text)
        end = min(int(end_text), size - 1) if end_text else size - 1
    except ValueError as error:
        raise ValueError(f"malformed range {header!r}") from error
    if start >= size or end < start:
        raise ValueError(f"range {header!r} outside a file of {size} bytes")
    return start, end


def _content_type(path: Path) -> str:
    return CONTENT_TYPES.get(path.suffix.lower()) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT  # an idle or stalled client does not hold a thread forever
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature inherited
        pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Malformed requests (a request line over 64 KiB, too many headers, a method other than
        GET and HEAD) are answered in JSON with the usual headers, as every other refusal is,
        not with the standard library's HTML page; the connection is closed after."""
        self.close_connection = True
        text = message or HTTPStatus(code).phrase
        self._send_json(
            JsonResponse({"error": f"{text}: {explain}" if explain else text}, code), self.command != "HEAD"
        )

    def do_GET(self) -> None:
        self._dispatch(send_body=True)

    def do_HEAD(self) -> None:
        self._dispatch(send_body=False)

    def _dispatch(self, send_body: bool) -> None:
        try:
            if not self._host_allowed():
                return self._send_json(JsonResponse({"error": "unknown host"}, HTTPStatus.FORBIDDEN), send_body)
            path = unquote(urlsplit(self.path).path)
            if self._from_another_origin(path):
                refused = JsonResponse({"error": "request from another site's page refused"}, HTTPStatus.FORBIDDEN)
                return self._send_json(refused, send_body)
            response = self._route(path)
            if isinstance(response, FileResponse):
                try:
                    return self._send_file(response.path, send_body)
                finally:
                    if response.release is not None:
                        response.release()
            return self._send_json(response, send_body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _host_allowed(self) -> bool:
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
        return host in ("127.0.0.1", "localhost", "")

    def _from_another_origin(self, path: str) -> bool:
        """Whether a browser says a page of another origin (another site, or another port of
        this host) made this request other than by navigating to the viewer's page: a ``<video>``,
        ``<img>``, ``<script>`` or ``fetch`` there would load episode data or start a render here,
        and so would a link or ``window.open`` of ``/video/...`` (the user's tab shows it, the
        page that opened it cannot read it, but every one renders a video). Browsers
        that send no ``Sec-Fetch-Site`` (Safari before 16.4) still name the page's origin in
        ``Origin`` on a ``fetch``; one other than this server's own (``null`` too: a sandboxed
        frame or a local file) is refused."""
        site = self.headers.get("Sec-Fetch-Site")
        navigating = self.headers.get("Sec-Fetch-Mode") == "navigate"
        opens_the_page = navigating and self.headers.get("Sec-Fetch-Dest", "document") == "document" and path in PAGES
        if site in FOREIGN_SITES and not opens_the_page:
            return True  # a top-level navigation opens the viewer; a frame there does not
        origin = self.headers.get("Origin")
        port = self.server.server_address[1]
        return origin is not None and origin not in (f"http://{HOST}:{port}", f"http://localhost:{port}")

    def _send_common_headers(self) -> None:
        """What every answer carries: no other origin may embed or frame it, nor sniff it as
        another type, and a page runs only the viewer's own scripts."""
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        self.send_header("X-Frame-Options", "DENY")

    def _route(self, path: str) -> JsonResponse | FileResponse:
        app = self.server.app
        try:
            if path in PAGES:
                return FileResponse(STATIC_DIR / app.page)
            if path.startswith("/static/"):
                name = path[len("/static/") :]
                if name in self.server.static_names:
                    return FileResponse(STATIC_DIR / name)
                raise NotFound(path)
            if path.startswith(("/api/", "/video/")):
                return app.respond(path)
            raise NotFound(path)
        except NotFound as error:
            return JsonResponse({"error": f"not found: {error}"}, HTTPStatus.NOT_FOUND)
        except (ValueError, TypeError) as error:
            return JsonResponse({"error": str(error)}, HTTPStatus.BAD_REQUEST)
        except Exception as error:  # a failed render must answer, not kill the connection
            print(f"replaybuf viewer: {path}: {type(error).__name__}: {error}", file=sys.stderr)
            return JsonResponse({"error": f"{type(error).__name__}: {error}"}, HTTPStatus.INTERNAL_SERVER_ERROR)

    def _send_json(self, response: JsonResponse, send_body: bool) -> None:
        body = json.dumps(response.body, allow_nan=False).encode()
        self.send_response(response.status)
        self._send_common_headers()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _send_file(self, path: Path, send_body: bool) -> None:
        try:
            size = path.stat().st_size
        except OSError as error:  # removed since it was named (a cache cleared by stop())
            return self._send_json(JsonResponse({"error": f"{error}"}, HTTPStatus.NOT_FOUND), send_body)
        try:
            byte_range = parse_range(self.headers.get("Range"), size)
        except ValueError:
            self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
            self._send_common_headers()
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end = byte_range if byte_range is not None else (0, size - 1)
        self.send_response(HTTPStatus.PARTIAL_CONTENT if byte_range is not None else HTTPStatus.OK)
        self._send_common_headers()
        self.send_header("Content-Type", _content_type(path))
        self.send_header("Content-Length", str(max(end - start + 1, 0)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Cache-Control", "no-cache")
        if byte_range is not None:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if not send_body:
            return
        with open(path, "rb") as file:
            file.seek(start)
            remaining = end - start + 1
            while remaining > 0:
                chunk = file.read(min(remaining, COPY_CHUNK))
                if not chunk:
                    break
                self.wfile.write(chunk)
                remaining -= len(chunk)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, app: ViewerApp):
        self.app = app
        self.static_names = frozenset(entry.name for entry in STATIC_DIR.iterdir() if entry.is_file())
        super().__init__((HOST, port), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up or went idle is not an error worth a traceback; others are."""
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


def check_port(port: int) -> None:
    """Raise the ``OSError`` ``ViewerServer`` would raise when ``port`` cannot be listened on,
    before work that precedes serving (rendering videos); 0 (a free port) always passes."""
    if port:
        try:
            _HTTPServer(port, None).server_close()  # type: ignore[arg-type]  # no request is handled
        except OSError as error:
            raise _listen_error(port, error) from error


def _listen_error(port: int, error: OSError) -> OSError:
    return OSError(
        f"cannot listen on {HOST}:{port} ({error.strerror or error}); pick another port, or 0 for a free one"
    )


class ViewerServer:
    """Serves one viewer app on 127.0.0.1; ``port=0`` picks a free port.

    Use ``start()`` / ``stop()`` (or ``with``) to run it in a background thread, or
    ``serve_forever()`` to block until Ctrl-C. Stopping closes the app (its temp files).
    """

    def __init__(self, app: ViewerApp, port: int = 0):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port: expected an integer in 0..65535, got {port!r}")
        self.app = app
        try:
            self._httpd = _HTTPServer(port, app)
        except OSError as error:
            app.close()
            raise _listen_error(port, error) from error
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/"

    def start(self) -> ViewerServer:
        """Serve in a daemon thread and return at once."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": POLL_INTERVAL},
                name="replaybuf-viewer",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, free the port and close the app."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        self.app.close()

    def serve_forever(self, open_browser: bool = True) -> None:
        """Block serving until interrupted (Ctrl-C / SIGINT), then stop. SIGTERM (``kill``, a
        service manager) stops it the same way, so the app's temp files go either way; the
        process then exits with status 143, as a process killed by SIGTERM does. SIGINT stops it
        also where the process started with it ignored (a job a shell put in the background
        without job control, whose Python installs no Ctrl-C handler)."""
        # the handlers go in before the line that tells a supervisor the server is up
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main_thread else None
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler) if in_main_thread else None
        try:  # a SIGTERM right after the line below (a supervisor acting on it) still stops
            print(f"serving {self.url} (ctrl-c to stop)", flush=True)
            if open_browser:
                threading.Thread(target=webbrowser.open, args=(self.url,), daemon=True).start()
            self._httpd.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()
            if in_main_thread:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
                signal.signal(signal.SIGINT, signal.SIG_DFL if previous_int is None else previous_int)

    def __enter__(self) -> ViewerServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def remove_tree(path: Path | None) -> None:
    """Remove a temp folder the viewer created, ignoring one already gone."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
