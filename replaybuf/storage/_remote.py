"""Open zarr v3 stores for URLs (s3://, gs://, memory://, any fsspec URL, local paths).

`open_store` turns a URL and fsspec-style ``storage_options`` into a ``zarr.abc.store.Store``;
`ProcessLocalStore` wraps that in a store that reopens itself in every new process, so no HTTP
session, event loop or Rust runtime crosses a fork into DataLoader workers.

Which library serves which URL
------------------------------
============================  ==================================================================
URL                           store
============================  ==================================================================
``s3://``, ``s3a://``         ``zarr.storage.ObjectStore(obstore.store.S3Store)`` when obstore is
                              installed and every option translates (table below); otherwise
                              ``FsspecStore`` over s3fs. Measured against moto on 127.0.0.1 (2
                              busy cores): 6-12 ms per small GET through obstore vs 36-45 ms
                              through s3fs; client CPU 1.4 vs 12 ms per GET.
``gs://``, ``gcs://``         ``FsspecStore`` over gcsfs. obstore's GCSStore cannot be tested here:
                              against gcp-storage-emulator its GET/PUT fail ("ETag"/"Last-Modified
                              header missing"), HEAD and XML listing answer 501. With an
                              ``endpoint_url`` (or ``STORAGE_EMULATOR_HOST``, which gcsfs reads)
                              the core ``gcsfs.GCSFileSystem`` is used, whatever
                              ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` says, because the experimental
                              class probes each bucket over gRPC (60 s against an emulator).
                              gcsfs retries a refused connection 6 times (~34 s) before failing;
                              the count is fixed in gcsfs (obstore on S3: ~0.6 s, s3fs: ~3 s).
``memory://`` and any other   ``FsspecStore.from_url`` (fsspec picks the filesystem; a missing
fsspec protocol               package is reported with fsspec's install hint).
plain path, ``file://``       ``zarr.storage.LocalStore``.
============================  ==================================================================

s3fs-style ``storage_options`` -> obstore ``S3Store``
------------------------------------------------------
===================================================  ============================================
s3fs / botocore option                               obstore
===================================================  ============================================
``endpoint_url``, ``client_kwargs['endpoint_url']``  ``endpoint``; ``http://`` also sets
or, as botocore, ``AWS_ENDPOINT_URL_S3`` or          ``client_options['allow_http'] = True``
``AWS_ENDPOINT_URL`` in the environment
``key``, ``aws_access_key_id``                       ``access_key_id``
``secret``, ``aws_secret_access_key``                ``secret_access_key``
``token``, ``aws_session_token``                     ``session_token``
``client_kwargs['region_name']``, ``region(_name)``  ``region``
``anon=True``                                        ``skip_signature=True`` (``False``: ignored)
``profile``                                          ``credential_provider=BotocoreCredentials``
no credentials, but ``AWS_PROFILE``/``~/.aws``       the same: botocore's chain, as s3fs resolves
``requester_pays=True``                              ``request_payer=True``
``client_options`` (obstore only)                    merged into obstore's HTTP client options
``retry_config`` (obstore only)                      replaces `DEFAULT_RETRY_CONFIG`
===================================================  ============================================

Any other key (e.g. ``config_kwargs``, ``use_ssl``, ``session``) has no obstore equivalent and
sends the URL to s3fs with the options as given (minus the obstore-only keys, with a warning;
plus ``max_concurrency=1`` unless given, which saves a HEAD request before every GET, and the
timeouts and tries of `S3FS_CONFIG_DEFAULTS` where ``config_kwargs`` does not set them).
Options not given come from the environment exactly as each library reads it (``AWS_*`` for
obstore and botocore, ``GOOGLE_APPLICATION_CREDENTIALS`` etc. for gcsfs). Secrets are never
logged: `store_key` and every repr here hide them.

Fork safety
-----------
obstore runs its I/O on a process-wide Rust runtime that does not survive ``fork``: in a forked
child every obstore call hangs once the parent has done obstore I/O, even on a freshly built
store (measured; a child reusing the parent's s3fs store raises instead). So:

- `ProcessLocalStore` records the pid that opened its backing store and reopens when called from
  another pid; pickling carries only ``(url, storage_options, read_only)``, so spawned workers
  open their own store on first use. ``store.is_stale`` tells a caller it is in such a child.
- `open_store` for s3 in a process forked from one that opened an obstore store returns an s3fs
  store instead (it works after fork, only slower). DataLoaders with
  ``multiprocessing_context='spawn'`` or ``'forkserver'`` keep obstore in their workers.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore, ObjectStore, WrapperStore

from ._settle import guarded_loop
from .base import OBJECT_STORE_SCHEMES, environment_endpoint

if TYPE_CHECKING:
    from zarr.abc.store import ByteRequest
    from zarr.core.buffer import Buffer, BufferPrototype

__all__ = [
    "DEFAULT_RETRY_CONFIG",
    "BotocoreCredentials",
    "NamedErrorStore",
    "ProcessLocalStore",
    "RemoteStoreError",
    "open_store",
    "redact_options",
    "store_key",
]

logger = logging.getLogger(__name__)

DEFAULT_RETRY_CONFIG: dict[str, Any] = {
    "max_retries": 4,
    "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2), "base": 2},
    "retry_timeout": timedelta(seconds=30),
}
"""obstore retries for transient errors (5xx, dropped connections): 4 tries, 0.1 s doubling to 2 s,
at most 30 s in all, so a stopped server surfaces as an error within about a second."""

S3FS_RETRIES = 1
S3FS_CONFIG_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 20,
    "retries": {"mode": "standard", "total_max_attempts": 3},
}
"""s3fs's tries of a request and botocore's settings (unless ``config_kwargs`` in
``storage_options`` give them): a request that gets no answer fails after 3 tries of 20 s, near
obstore's minute. s3fs's own tries (5) nest (a read retries a call that retries itself) around
botocore's (5 attempts with a 60 s read timeout), so against a server that accepts connections
and never answers, an open through s3fs was still waiting after 7 minutes (measured; 123 s with
these, obstore 60 s). botocore alone retries 5xx, throttling and dropped connections."""

_S3_SCHEMES = frozenset(scheme for scheme, store in OBJECT_STORE_SCHEMES.items() if store == "s3")
_GCS_SCHEMES = frozenset(scheme for scheme, store in OBJECT_STORE_SCHEMES.items() if store == "gs")
_LOCAL_SCHEMES = frozenset({"", "file"})
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_GCS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._\-]{1,220}[a-z0-9]$")
_SECRET_NAME = re.compile(r"key|secret|token|password|passwd|credential", re.IGNORECASE)

_S3FS_TO_OBSTORE = {
    "endpoint_url": "endpoint",
    "key": "access_key_id",
    "aws_access_key_id": "access_key_id",
    "secret": "secret_access_key",
    "aws_secret_access_key": "secret_access_key",
    "token": "session_token",
    "aws_session_token": "session_token",
    "region_name": "region",
    "region": "region",
}
_CLIENT_KWARGS_TO_OBSTORE = {
    "endpoint_url": "endpoint",
    "region_name": "region",
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "aws_session_token": "session_token",
}
# botocore client argument -> (the s3fs option for it, or None where s3fs takes it in client_kwargs
# only; the other top-level spellings obstore's translation takes)
_S3_ARGUMENTS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "endpoint_url": ("endpoint_url", ()),
    "aws_access_key_id": ("key", ("aws_access_key_id",)),
    "aws_secret_access_key": ("secret", ("aws_secret_access_key",)),
    "aws_session_token": ("token", ("aws_session_token",)),
    "region_name": (None, ("region", "region_name")),
}
_OBSTORE_ONLY = frozenset({"client_options", "retry_config"})
_EXPLICIT_CREDENTIALS = frozenset(
    {"key", "secret", "token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
)

# pid of the process that opened an obstore store; a forked child inherits it and so knows
# that obstore's runtime there is unusable.
_obstore_opened_in_pid: int | None = None


class RemoteStoreError(OSError):
    """A storage request failed after the client's retries (server down, refused, denied)."""


def open_store(
    url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, read_only: bool = False
) -> Store:
    """Open the zarr store at ``url`` in this process (see the module docstring for the mapping).

    Remote stores come wrapped in `NamedErrorStore` (``._store`` is the store from the table), so
    a failed request raises `RemoteStoreError`, an ``OSError``.

    Parameters
    ----------
    url
        ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``memory://name``, another fsspec URL,
        or a local path.
    storage_options
        fsspec-style options (s3fs/gcsfs keyword arguments); translated for obstore where it
        serves the URL.
    read_only
        Open without write permission; zarr then refuses every write before it is sent.

    Raises
    ------
    TypeError, ValueError
        ``url``, ``storage_options`` or ``read_only`` malformed (names the bad part).
    ImportError
        The package serving the URL's scheme is not installed (with the install hint).
    """
    url, options = _check_arguments(url, storage_options, read_only)
    scheme = _scheme(url)
    if scheme in _LOCAL_SCHEMES:
        path = url[len("file://") :] if scheme == "file" else url
        return LocalStore(Path(path).expanduser(), read_only=read_only)
    if scheme in _S3_SCHEMES:
        _check_bucket(url, _S3_BUCKET, "S3")
        store = _open_s3(url, options, read_only)
    elif scheme in _GCS_SCHEMES:
        _check_bucket(url, _GCS_BUCKET, "GCS")
        store = _open_gcs(url, options, read_only)
    else:
        store = _open_fsspec(url, options, read_only)
    return NamedErrorStore(store, store_key(url, options))


def store_key(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> str:
    """A stable, secret-free identity for (url, options): safe for logs, reprs and cache keys."""
    options = redact_options(storage_options or {})
    if not options:
        return os.fspath(url)
    rendered = ", ".join(f"{name}={value!r}" for name, value in sorted(options.items()))
    return f"{os.fspath(url)} [{rendered}]"


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of ``options`` with every credential-like value (key, secret, token ...) as ``'***'``."""
    redacted: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, Mapping):
            redacted[name] = redact_options(value)
        elif _SECRET_NAME.search(str(name)) and value not in (None, "anon", False):
            redacted[name] = "***"
        else:
            redacted[name] = value
    return redacted


def _check_arguments(url: Any, storage_options: Any, read_only: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        raise TypeError(f"url must be a str or path, got {type(url).__name__}: {url!r}")
    if not url.strip():
        raise ValueError("url is empty; expected a local path or a URL such as 's3://bucket/path'")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
    if not isinstance(read_only, bool):
        raise TypeError(f"read_only must be True or False, got {read_only!r}")
    options = dict(storage_options or {})
    for name in options:
        if not isinstance(name, str):
            raise TypeError(f"storage_options keys must be str, got {name!r}")
    endpoint = options.get("endpoint_url")
    if endpoint is not None and not (isinstance(endpoint, str) and re.match(r"^https?://[^/]+", endpoint)):
        raise ValueError(f"storage_options['endpoint_url'] must be an http(s):// URL, got {endpoint!r}")
    if "anon" in options and not isinstance(options["anon"], bool):
        raise TypeError(f"storage_options['anon'] must be True or False, got {options['anon']!r}")
    return url, options


def _scheme(url: str) -> str:
    if "://" not in url:
        return ""
    scheme = url.split("://", 1)[0].lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.\-]*", scheme):
        raise ValueError(f"url {url!r} has a malformed scheme {scheme!r}; expected e.g. 's3://bucket/path'")
    return scheme


def _check_bucket(url: str, pattern: re.Pattern[str], service: str) -> None:
    _check_object_path(url)
    bucket = urlsplit(url).netloc
    if not bucket:
        raise ValueError(f"url {url!r} names no bucket; expected {url.split('://')[0]}://<bucket>/<path>")
    if not pattern.match(bucket):
        raise ValueError(
            f"url {url!r}: {bucket!r} is not a valid {service} bucket name "
            "(3-63 lowercase letters, digits, '-' or '.', starting and ending with a letter or digit)"
        )


def _check_object_path(url: str) -> None:
    """Refuse an object-store path the clients read differently, so it could name another prefix:
    obstore drops a ``?query`` or ``#fragment`` (``overwrite=True`` at ``s3://b/x#run2`` replaced
    the buffer at ``s3://b/x``) and refuses ``//``, ``.`` and ``..`` segments, which s3fs keeps
    as key characters (a buffer its forked workers write there, obstore cannot open)."""
    path = url.split("://", 1)[1].partition("/")[2]
    if "?" in path or "#" in path:
        found = "a '?' (query)" if "?" in path else "a '#' (fragment)"
    elif path.startswith("/") or "//" in path:
        found = "an empty segment ('//')"
    elif any(segment in (".", "..") for segment in path.split("/")):
        found = "a '.' or '..' segment"
    else:
        return
    raise ValueError(
        f"url {url!r}: the path {path!r} has {found}, which object-store clients read differently "
        "(some drop or resolve it, others keep it), so the buffer could land on another prefix; "
        "expected segments of other characters, e.g. 's3://bucket/runs/run1'"
    )


def _s3fs_spelling(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with each botocore client argument spelled as s3fs takes it (`_S3_ARGUMENTS`):
    obstore's translation took ``region``, ``region_name`` or ``aws_access_key_id`` at the top
    level, which s3fs refuses ("AioSession.__init__() got an unexpected keyword argument"), so a
    buffer opened through obstore failed in its forked DataLoader workers (served by s3fs).

    Raises ValueError for an argument given twice with two values (``endpoint_url`` and
    ``client_kwargs['endpoint_url']``, ``key`` and ``aws_access_key_id``): s3fs refuses those
    ("multiple values") while obstore took one, so the buffer could go to a server the other
    value named."""
    spelled = dict(options)
    client = spelled.get("client_kwargs")
    if client is not None and not isinstance(client, Mapping):
        raise TypeError(f"storage_options['client_kwargs'] must be a dict, got {type(client).__name__}: {client!r}")
    client = None if client is None else dict(client)
    for argument, (s3fs_name, aliases) in _S3_ARGUMENTS.items():
        given = {name: spelled.pop(name) for name in (s3fs_name, *aliases) if name and name in spelled}
        if client is not None and argument in client:
            given[f"client_kwargs['{argument}']"] = client.pop(argument)
        given = {name: value for name, value in given.items() if value is not None}
        if len({repr(value) for value in given.values()}) > 1:
            shown = ", ".join(
                f"{name}={redact_options({argument: value})[argument]!r}" for name, value in given.items()
            )
            raise ValueError(
                f"storage_options give the S3 client's {argument!r} twice with two values ({shown}); give it once"
            )
        if given and s3fs_name:
            spelled[s3fs_name] = next(iter(given.values()))
        elif given:
            client = {**(client or {}), argument: next(iter(given.values()))}
    if client is not None:
        spelled["client_kwargs"] = client
    return spelled


def _open_s3(url: str, options: dict[str, Any], read_only: bool) -> Store:
    global _obstore_opened_in_pid
    options = _s3fs_spelling(options)
    untranslatable = sorted(set(options) - _translatable_s3_keys(options))
    reason = _obstore_unavailable_reason() or (
        f"storage_options {untranslatable} have no obstore equivalent" if untranslatable else None
    )
    if reason is not None:
        logger.info("opening %s with s3fs: %s", store_key(url, options), reason)
        # s3fs's default max_concurrency=10 sends a HEAD before every whole-object GET (2 requests
        # per chunk); chunks are fetched concurrently by the caller, so one GET each is enough.
        s3fs_store = _open_fsspec(url, _s3fs_options(_without_obstore_only(options)), read_only)
        s3fs_store.fs.retries = S3FS_RETRIES  # a class attribute of s3fs, no constructor argument
        return s3fs_store
    from obstore.store import S3Store

    parts = urlsplit(url)
    store = S3Store(parts.netloc, prefix=parts.path.strip("/") or None, **_s3_options_to_obstore(options))
    _obstore_opened_in_pid = os.getpid()
    guarded_loop()  # its requests run on zarr's loop, also through zarr's API (``ProcessLocalStore``)
    return ObjectStore(store, read_only=read_only)


def _s3fs_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for s3fs with ``max_concurrency=1`` and `S3FS_CONFIG_DEFAULTS` where not given."""
    given = options.get("config_kwargs") or {}
    if not isinstance(given, Mapping):
        raise TypeError(f"storage_options['config_kwargs'] must be a dict, got {type(given).__name__}: {given!r}")
    config = {**S3FS_CONFIG_DEFAULTS, **given}
    return {"max_concurrency": 1, **options, "config_kwargs": config}


def _obstore_unavailable_reason() -> str | None:
    if _obstore_opened_in_pid not in (None, os.getpid()):
        return (
            f"obstore hangs in a process forked after its runtime started (pid {_obstore_opened_in_pid}); "
            "use DataLoader(multiprocessing_context='spawn' or 'forkserver') to keep obstore in workers"
        )
    try:
        import obstore  # noqa: F401
    except ImportError:
        return "obstore is not installed (pip install 'replaybuf[s3]')"
    return None


def _translatable_s3_keys(options: Mapping[str, Any]) -> set[str]:
    keys = set(_S3FS_TO_OBSTORE) | _OBSTORE_ONLY | {"anon", "requester_pays", "profile"}
    client_kwargs = options.get("client_kwargs")
    if isinstance(client_kwargs, Mapping) and set(client_kwargs) <= set(_CLIENT_KWARGS_TO_OBSTORE):
        keys.add("client_kwargs")
    return keys & set(options)


def _s3_options_to_obstore(options: Mapping[str, Any]) -> dict[str, Any]:
    """s3fs-style options (all translatable, see the module table) -> ``S3Store`` keyword arguments."""
    config: dict[str, Any] = {}
    for name, value in {**options, **options.get("client_kwargs", {})}.items():
        target = _S3FS_TO_OBSTORE.get(name) or _CLIENT_KWARGS_TO_OBSTORE.get(name)
        if target is not None and value is not None:
            config[target] = value
    if options.get("anon"):
        config["skip_signature"] = True
    if options.get("requester_pays"):
        config["request_payer"] = True
    from_environment = environment_endpoint()
    if "endpoint" not in config and from_environment is not None:
        # as an option, so an http:// one gets allow_http below: from the environment alone
        # obstore refused it ("builder error") unless AWS_ALLOW_HTTP was set, where s3fs reached it
        config["endpoint"] = from_environment
    client_options = dict(options.get("client_options") or {})
    if str(config.get("endpoint", "")).startswith("http://"):
        client_options.setdefault("allow_http", True)
    return {
        "config": config,
        "client_options": client_options or None,
        "retry_config": options.get("retry_config") or DEFAULT_RETRY_CONFIG,
        "credential_provider": _profile_credentials(options, config),
    }


def _profile_credentials(options: Mapping[str, Any], config: Mapping[str, Any]) -> BotocoreCredentials | None:
    """botocore's credential chain where obstore's own (env vars, web identity, instance role) would
    miss what s3fs finds: a ``profile`` option, ``AWS_PROFILE``, or ``~/.aws`` files."""
    if "profile" in options:
        return BotocoreCredentials(options["profile"])
    if options.get("anon") or _EXPLICIT_CREDENTIALS & set(options) or "access_key_id" in config:
        return None
    if "AWS_ACCESS_KEY_ID" in os.environ:
        return None
    aws_files = [
        os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
        os.environ.get("AWS_CONFIG_FILE", "~/.aws/config"),
    ]
    if "AWS_PROFILE" in os.environ or any(Path(name).expanduser().is_file() for name in aws_files):
        return BotocoreCredentials(None)
    return None


class BotocoreCredentials:
    """obstore credential provider resolving AWS credentials as botocore (and so s3fs) does.

    Covers named profiles, ``~/.aws`` files and SSO, which obstore does not read itself. Holds
    only the profile name, so it pickles to worker processes; credentials are looked up lazily on
    the first request and refreshed every `REFRESH` (botocore renews expiring ones).
    """

    REFRESH = timedelta(minutes=5)

    def __init__(self, profile: str | None) -> None:
        self.profile = profile
        self._credentials: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"profile": self.profile}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.profile, self._credentials = state["profile"], None

    def __call__(self) -> dict[str, Any]:
        import botocore.session

        if self._credentials is None:
            self._credentials = botocore.session.Session(profile=self.profile).get_credentials()
        if self._credentials is None:
            where = f"profile {self.profile!r}" if self.profile else "AWS_PROFILE / ~/.aws"
            raise PermissionError(f"no AWS credentials found for {where}")
        frozen = self._credentials.get_frozen_credentials()
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(UTC) + self.REFRESH,
        }


def _without_obstore_only(options: dict[str, Any]) -> dict[str, Any]:
    dropped = sorted(_OBSTORE_ONLY & set(options))
    if dropped:
        logger.warning("storage_options %s apply to obstore only and are ignored by s3fs", ", ".join(dropped))
    return {name: value for name, value in options.items() if name not in _OBSTORE_ONLY}


def _open_gcs(url: str, options: dict[str, Any], read_only: bool) -> Store:
    if "endpoint_url" not in options and environment_endpoint("gs") is None:
        return _open_fsspec(url, options, read_only)
    try:
        from gcsfs.core import GCSFileSystem
    except ImportError as error:
        raise ImportError(f"url {url!r} needs gcsfs: pip install 'replaybuf[gcs]'") from error
    fs = GCSFileSystem(**{"asynchronous": True, **options})
    return FsspecStore(fs=fs, path=url.split("://", 1)[1].rstrip("/"), read_only=read_only)


# the extra of replaybuf that installs what a scheme's store needs (README: Backends and locations)
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def _open_fsspec(url: str, options: dict[str, Any], read_only: bool) -> FsspecStore:
    try:
        return FsspecStore.from_url(url, storage_options=options, read_only=read_only)
    except ImportError as error:
        extra = _EXTRAS.get(_scheme(url))
        install = f"pip install 'replaybuf[{extra}]'" if extra else "install the fsspec implementation of its scheme"
        raise ImportError(f"url {url!r} needs an extra package: {install} ({error})") from error
    except ValueError as error:
        if "Protocol not known" in str(error):
            import fsspec

            known = sorted(fsspec.available_protocols())
            raise ValueError(f"url {url!r}: unknown scheme {_scheme(url)!r}; fsspec knows {known}") from error
        raise


_NOT_WRAPPED = (FileNotFoundError, ValueError, TypeError, KeyError, NotImplementedError, RemoteStoreError)


class NamedErrorStore(WrapperStore[Store]):
    """Wraps a remote store so failures read "<OP> <key> on <url> failed: ..." as `RemoteStoreError`.

    What obstore, s3fs and gcsfs raise when a server is down or refuses differs (obstore's errors
    are not even ``OSError``); callers get one ``OSError`` subclass naming the operation, the key
    and the store (never its secrets). "Not found" and zarr's argument errors pass unchanged.
    """

    def __init__(self, store: Store, name: str) -> None:
        self._store = store
        self.name = name

    def _with_store(self, store: Store) -> NamedErrorStore:
        return NamedErrorStore(store, self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"NamedErrorStore({type(self._store).__name__}, {self.name!r})"

    @contextmanager
    def _named(self, operation: str, key: str) -> Iterator[None]:
        """Raise a failure inside as RemoteStoreError naming ``operation``, ``key`` and the store."""
        try:
            yield
        except _NOT_WRAPPED:
            raise
        except Exception as error:
            summary = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
            raise RemoteStoreError(
                f"{operation} {key!r} on {self.name} failed: {type(error).__name__}: {summary}"
            ) from error

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        # docstring inherited
        with self._named("GET", key):
            return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        # docstring inherited
        key_ranges = list(key_ranges)
        with self._named("GET (ranges)", key_ranges[0][0] if key_ranges else ""):
            return await self._store.get_partial_values(prototype, key_ranges)

    async def exists(self, key: str) -> bool:
        # docstring inherited
        with self._named("HEAD", key):
            return await self._store.exists(key)

    async def getsize(self, key: str) -> int:
        # docstring inherited: the wrapped store's (a HEAD), not Store's default, which reads
        # the whole object to measure it
        with self._named("HEAD", key):
            return await self._store.getsize(key)

    async def set(self, key: str, value: Buffer) -> None:
        # docstring inherited
        with self._named("PUT", key):
            await self._store.set(key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        # docstring inherited
        with self._named("PUT (if absent)", key):
            await self._store.set_if_not_exists(key, value)

    async def delete(self, key: str) -> None:
        # docstring inherited
        with self._named("DELETE", key):
            await self._store.delete(key)

    async def delete_dir(self, prefix: str) -> None:
        # docstring inherited
        with self._named("DELETE (prefix)", prefix):
            await self._store.delete_dir(prefix)

    async def _listing(self, prefix: str, listing: AsyncIterator[str]) -> AsyncIterator[str]:
        with self._named("LIST", prefix):
            async for key in listing:
                yield key

    def list(self) -> AsyncIterator[str]:
        # docstring inherited
        return self._listing("", self._store.list())

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        # docstring inherited
        return self._listing(prefix, self._store.list_prefix(prefix))

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        # docstring inherited
        return self._listing(prefix, self._store.list_dir(prefix))


class ProcessLocalStore(WrapperStore[Store]):
    """A zarr store for a URL that opens its backing store once per process.

    Use it where a store may reach another process: a zarr array or dataset pickled to spawned
    DataLoader workers, or inherited by forked ones. Each process opens its own client (via
    `open_store`) on first use; ``is_stale`` is True in a process that has not done so yet.

    Parameters
    ----------
    url, storage_options, read_only
        As for `open_store`, which validates them here, at construction.
    """

    def __init__(
        self, url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, *, read_only: bool = False
    ) -> None:
        self.url, self.storage_options = _check_arguments(url, storage_options, read_only)
        self._read_only = read_only
        self._inner: Store | None = open_store(self.url, self.storage_options, read_only)
        self.opened_pid: int | None = os.getpid()

    # WrapperStore's attribute, made a property so that each process opens its own client
    @property
    def _store(self) -> Store:  # type: ignore[override]
        if self.is_stale:
            self.reopen()
        assert self._inner is not None  # opened by reopen()
        return self._inner

    @property
    def is_stale(self) -> bool:
        """True in a process (forked child, unpickled copy) that has not opened its own store yet."""
        return self.opened_pid != os.getpid()

    def reopen(self) -> None:
        """Open a fresh backing store in this process; the inherited one is dropped unused."""
        self._inner = open_store(self.url, self.storage_options, self._read_only)
        self.opened_pid = os.getpid()

    @property
    def backend(self) -> str:
        """Which client serves this process: 'obstore', the fsspec filesystem class, or 'local'."""
        inner = self._store
        if isinstance(inner, NamedErrorStore):
            inner = inner._store
        if isinstance(inner, ObjectStore):
            return "obstore"
        if isinstance(inner, FsspecStore):
            return type(inner.fs).__name__
        return "local"

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options, "read_only": self._read_only}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url, self.storage_options, self._read_only = state["url"], state["storage_options"], state["read_only"]
        self._inner = None
        self.opened_pid = None

    def with_read_only(self, read_only: bool = False) -> ProcessLocalStore:
        # docstring inherited
        return ProcessLocalStore(self.url, self.storage_options, read_only=read_only)

    def __enter__(self) -> ProcessLocalStore:
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessLocalStore) and (self.url, self.storage_options, self._read_only) == (
            other.url,
            other.storage_options,
            other._read_only,
        )

    def __hash__(self) -> int:
        return hash((type(self), self.url, self._read_only))

    def __str__(self) -> str:
        return store_key(self.url, self.storage_options)

    def __repr__(self) -> str:
        return f"ProcessLocalStore({str(self)!r}, read_only={self._read_only})"
