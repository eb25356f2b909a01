"""Where the remote tier lives and how it moves bytes: :class:`Remote`.

A :class:`Remote` names an object store by URL (``s3://bucket/prefix``, ``gs://``,
``az://``, ``file:///path``, ``memory:///``) with the client's options, and says how
uploads run (chunk size and concurrency of multipart uploads, attempts, a deadline per
step) and which committed steps go up (every N-th) and stay (a retention policy).
Credentials come from the options or from the environment, as the client (``obstore``)
finds them; they are never logged or shown: ``repr`` and every message name the URL
without its user part or query.
"""

from __future__ import annotations

import math
import threading
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from .._files.policies import Policy, as_policy
from .._util.errors import ConfigurationError

if TYPE_CHECKING:
    from .client import RemoteClient

SCHEMES: Final = frozenset({"s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "file", "memory"})
"""URL schemes a :class:`Remote` accepts (the stores ``obstore.store.from_url`` builds)."""

MIB: Final = 1 << 20


def shown_url(url: str) -> str:
    """``url`` without user, password or query: safe to log."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def _positive_int(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ConfigurationError(f"Remote {name} must be an int >= 1, got {value!r}")
    return value


class Remote:
    """The remote tier of a :class:`~astage.Checkpointer`: an object store and its policy.

    ::

        remote = astage.Remote("s3://bucket/run-7", options={"region": "eu-west-1"},
                               every=10, keep=astage.latest(2))
        async with astage.Checkpointer("ckpt", remote=remote) as ckpt: ...

    :param url: the store and the prefix under which this run's steps live.
    :param options: the store's configuration, as ``obstore.store.from_url`` takes it
        (``endpoint``, ``region``, ``access_key_id``, ...); what is not given comes from
        the environment (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``).
    :param client_options: HTTP client options (``allow_http``, ``timeout``, ...).
    :param world_size: ranks that write each step (a step is complete on the store once
        every rank's commit object is there); default: the ``torch.distributed`` world
        size when it is initialised, else 1.
    :param every: upload every N-th committed step (by count of commits: 1 uploads all).
    :param keep: retention on the store (a policy such as ``latest(2)``, an int ``n`` for
        ``latest(n)``, or ``None`` to keep every uploaded step).
    :param chunk_nbytes: the part size of multipart uploads (and of reads from disk).
    :param max_concurrency: parts in flight at once per object: memory held by an upload
        is about ``chunk_nbytes * (max_concurrency + 1)``.
    :param attempts: tries per object on transient errors (5xx, resets, timeouts), with
        exponential backoff between them; the client also retries each request.
    :param deadline: seconds one step's upload (or download) may take in all.
    :param run: this run's name (e.g. the job's id).  Given, the prefix is claimed for it
        (an ``astage-run.json`` object, created once) and a Checkpointer whose run differs
        from the prefix's owner fails when entered: two runs never mix their steps.
        ``None`` claims nothing and checks nothing.
    """

    def __init__(
        self,
        url: str,
        *,
        options: Mapping[str, Any] | None = None,
        client_options: Mapping[str, Any] | None = None,
        world_size: int | None = None,
        every: int = 1,
        keep: Policy | int | None = None,
        chunk_nbytes: int = 16 * MIB,
        max_concurrency: int = 4,
        attempts: int = 5,
        deadline: float = 1800.0,
        run: str | None = None,
    ) -> None:
        if not isinstance(url, str):
            raise ConfigurationError(f"Remote url must be a str, got {type(url).__name__}")
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme not in SCHEMES:
            raise ConfigurationError(
                f"Remote url {shown_url(url)!r}: expected one of the schemes {sorted(SCHEMES)}"
            )
        for name, value in (("options", options), ("client_options", client_options)):
            if value is not None and not isinstance(value, Mapping):
                raise ConfigurationError(f"Remote {name} must be a mapping, got {type(value).__name__}")
        if world_size is not None:
            _positive_int("world_size", world_size)
        if type(deadline) not in (int, float) or not (math.isfinite(deadline) and deadline > 0):
            raise ConfigurationError(
                f"Remote deadline must be a positive number of seconds, got {deadline!r}"
            )
        self.url = url
        self.scheme = scheme
        self.options: dict[str, Any] = dict(options or {})
        self.client_options: dict[str, Any] = dict(client_options or {})
        self.world_size = world_size
        self.every = _positive_int("every", every)
        self.keep: Policy | None = as_policy("Remote keep", keep)
        self.chunk_nbytes = _positive_int("chunk_nbytes", chunk_nbytes)
        if chunk_nbytes < 5 * MIB and scheme in ("s3", "s3a"):
            raise ConfigurationError(f"Remote chunk_nbytes must be >= 5 MiB for S3, got {chunk_nbytes}")
        self.max_concurrency = _positive_int("max_concurrency", max_concurrency)
        self.attempts = _positive_int("attempts", attempts)
        self.deadline = float(deadline)
        if run is not None and (not isinstance(run, str) or not 0 < len(run) <= 256):
            raise ConfigurationError(f"Remote run must be a str of 1 to 256 characters, got {run!r:.80}")
        self.run = run
        self._client: RemoteClient | None = None
        self._lock = threading.Lock()

    @property
    def shown(self) -> str:
        """The URL as it may be logged (no credentials)."""
        return shown_url(self.url)

    def client(self) -> RemoteClient:
        """The store's client, made on first use and shared (a ``memory://`` store lives in it).

        :raises RemoteError: the client cannot be made (unknown option, bad URL).
        :raises ConfigurationError: ``obstore`` is not installed (``pip install astage[remote]``).
        """
        with self._lock:
            if self._client is None:
                try:
                    # obstore is an optional dependency (the ``remote`` extra): imported only
                    # by a program that configures a remote tier.
                    from .client import RemoteClient
                except ImportError as exc:
                    raise ConfigurationError(
                        "the remote tier needs obstore: pip install 'astage[remote]'"
                    ) from exc
                self._client = RemoteClient(self)
            return self._client

    def __repr__(self) -> str:
        return f"Remote({self.shown!r}, every={self.every}, keep={self.keep!r})"


def as_remote(value: Remote | str | None) -> Remote | None:
    """``value`` as a :class:`Remote` (a URL string makes one with the defaults)."""
    if value is None or isinstance(value, Remote):
        return value
    if isinstance(value, str):
        return Remote(value)
    raise ConfigurationError(f"remote must be a Remote, a URL or None, got {type(value).__name__}")
