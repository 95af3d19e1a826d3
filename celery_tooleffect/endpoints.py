"""Where a Redis the package uses is: every URL form kombu and Celery accept,
resolved once into a :class:`RedisEndpoint` (no I/O here: the clients are
:func:`celery_tooleffect.store.connections.client_for`'s).

Forms (for the broker, and for ``tooleffect_redis_url``):

- ``redis://[user:password@]host[:port][/db]`` and ``rediss://`` (TLS: the
  ``ssl_*`` options of the URL's query, completed by ``broker_use_ssl`` for
  the broker and ``redis_backend_use_ssl`` for a store of its own);
- ``redis+socket:///path[?virtual_host=db]`` (kombu's), ``socket:///path``
  (Celery's result backend) and ``unix:///path[?db=N]`` (redis-py's);
- a ``;``-separated failover list of those: the package's records stay on
  its **first** server. kombu moves the broker to the next server when one
  fails, but a journal on another server would know none of the intents
  recorded so far, and a non-idempotent write would run again; so the store
  never follows that move: while the first server is away, writes do not
  start (they are retried as ``connection`` failures). Redis that fails
  over belongs behind Sentinel;
- a ``;``-separated list of ``sentinel://host:port`` with the transport
  option ``master_name`` (and ``sentinel_kwargs``, ``min_other_sentinels``):
  the master the Sentinels name now, found again by redis-py's own
  ``Sentinel``/``SentinelConnectionPool`` after each failover. The URL's
  user, password and db are the master's, as kombu takes them.

What cannot be resolved is a :class:`~celery_tooleffect.errors.ConfigurationError`
naming the setting and the form; nothing falls back to another server.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import redis
from kombu.utils.url import url_to_parts

from .errors import ConfigurationError

#: Schemes of one direct Redis server.
DIRECT_SCHEMES = ("redis", "rediss", "redis+socket", "socket", "unix")
#: Every scheme of the Redis family (a broker URL in one of these is Redis).
REDIS_FAMILY = (*DIRECT_SCHEMES, "sentinel", "sentinels")

#: TLS options kombu (``broker_use_ssl``) and Celery (``redis_backend_use_ssl``)
#: pass to redis-py, by the same names.
SSL_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile",
               "ssl_check_hostname", "ssl_password", "ssl_min_version", "ssl_ciphers")

Pairs = tuple[tuple[str, Any], ...]


def scheme_of(url: str) -> str:
    """The scheme of ``url`` (of its first part for a list), lower case."""
    return url.split(";", 1)[0].strip().partition("://")[0].lower()


def is_redis_family(url: str) -> bool:
    """Whether ``url`` is a Redis broker URL kombu serves with its Redis transport."""
    return scheme_of(url) in REDIS_FAMILY


@dataclass(frozen=True)
class RedisEndpoint:
    """One Redis server, or the master a group of Sentinels names, and how to
    connect to it (redis-py connection keyword arguments)."""

    #: Connection keyword arguments: host and port, or path; db, username,
    #: password, and the ``ssl*`` options.
    connection: Pairs
    #: Behind Sentinel: the Sentinels' addresses and the master's name.
    sentinels: tuple[tuple[str, int], ...] = ()
    master_name: str = ""
    sentinel_kwargs: Pairs = ()
    min_other_sentinels: int = 0
    #: A Redis Cluster reached through this node (``tooleffect_redis_cluster``).
    cluster: bool = False
    #: The URL of the one server this was resolved from (for a cluster's node).
    url: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        # Computed once: an endpoint keys the client cache on every store call.
        object.__setattr__(self, "_hash", hash((
            self.connection, self.sentinels, self.master_name, self.sentinel_kwargs,
            self.min_other_sentinels, self.cluster)))

    def __hash__(self) -> int:
        return int(self.__dict__["_hash"])

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.connection)

    @property
    def behind_sentinel(self) -> bool:
        return bool(self.sentinels)

    @property
    def tls(self) -> bool:
        return bool(self.options.get("ssl"))

    @property
    def db(self) -> int:
        return int(self.options.get("db") or 0)

    def identity(self) -> tuple[Any, ...]:
        """Which server (or Sentinel-named master), database and user this
        reaches: two endpoints with the same identity may share a script."""
        if not self.sentinels:
            return server_identity(self.options)
        options = self.options
        return ("sentinel", frozenset(self.sentinels), self.master_name, self.db,
                options.get("username") or "default", options.get("password") or "")

    def reach(self) -> tuple[Any, ...]:
        """:meth:`identity` without the database: which server (or
        Sentinel-named master) this reaches, and as which user. Two endpoints
        with the same reach, outside a cluster, may share a script that
        ``SELECT`` the other's database."""
        identity = self.identity()
        return identity[:3] + identity[4:] if self.sentinels else identity[:2] + identity[3:]

    def server(self) -> tuple[Any, ...]:
        """Which server process (or Sentinel-named master) this reaches, whatever
        the database or user: two endpoints with the same server are rolled back
        together when it restarts from an older file."""
        if self.sentinels:
            return ("sentinel", frozenset(self.sentinels), self.master_name)
        return server_identity(self.options)[:2]

    def describe(self) -> str:
        """Where this is, for messages: no password."""
        options = self.options
        user = f"{options['username']}@" if options.get("username") else ""
        if self.sentinels:
            hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
            return f"master {self.master_name!r} of the Sentinels {hosts} (db {self.db})"
        if options.get("path"):
            return f"unix://{user}{options['path']} (db {self.db})"
        scheme = "rediss" if self.tls else "redis"
        return (f"{scheme}://{user}{options.get('host') or '127.0.0.1'}:"
                f"{options.get('port') or 6379}/{self.db}")


def server_identity(options: Mapping[str, Any]) -> tuple[Any, ...]:
    """Which server, database and user redis-py connection keyword arguments
    reach. The user counts too: a restricted ACL user may not touch every key."""
    path = options.get("path")
    return (path or options.get("host") or "127.0.0.1",
            0 if path else int(options.get("port") or 6379), int(options.get("db") or 0),
            options.get("username") or "default", options.get("password") or "")


def resolve(url: str, *, setting: str, transport_options: Mapping[str, Any] | None = None,
            ssl: Mapping[str, Any] | bool | None = None, cluster: bool = False) -> RedisEndpoint:
    """The endpoint ``url`` names. ``setting`` names where it came from, for
    the error; ``transport_options`` are the broker's (``master_name``,
    ``sentinel_kwargs``); ``ssl`` completes a ``rediss://`` URL's own options.
    """
    parts = [part.strip() for part in str(url).split(";") if part.strip()]
    if not parts:
        raise ConfigurationError(f"{setting} is empty: give a Redis URL (redis://host:6379/0)")
    schemes = {scheme_of(part) for part in parts}
    if schemes <= {"sentinel", "sentinels"}:
        return _sentinel(parts, setting, dict(transport_options or {}), ssl)
    if not schemes <= set(DIRECT_SCHEMES):
        raise ConfigurationError(
            f"{setting}: {masked_url(url)} is not a Redis URL the package can use (it accepts "
            "redis://, rediss://, redis+socket://, socket://, unix://, a ';'-separated "
            "failover list of those, or a ';'-separated list of sentinel://)"
        )
    if cluster and schemes - {"redis", "rediss"}:
        raise ConfigurationError(
            f"{setting}: a Redis Cluster (tooleffect_redis_cluster) is reached through one "
            f"node's redis:// or rediss:// URL, not {masked_url(url)}")
    # A failover list: the first server (see the module's docs).
    return RedisEndpoint(_direct(parts[0], setting, ssl), cluster=cluster, url=parts[0])


def _direct(url: str, setting: str, ssl: Mapping[str, Any] | bool | None) -> Pairs:
    scheme = scheme_of(url)
    try:
        if scheme in ("redis+socket", "socket"):
            parts = url_to_parts(url)
            query = dict(parts.query)
            # kombu reads a socket's database from ``virtual_host``; Celery's from ``db``.
            db = query.pop("virtual_host", None) or query.pop("db", None) or 0
            options: dict[str, Any] = {"path": "/" + unquote(parts.path or "").lstrip("/"),
                                       "db": int(db)}
            if parts.username:
                options["username"] = unquote(parts.username)
            if parts.password:
                options["password"] = unquote(parts.password)
            if not parts.path:
                raise ValueError("no socket path")
        else:
            options = dict(redis.connection.parse_url(url))  # type: ignore[no-untyped-call]
            # kombu reads ``redis://host//`` (virtual host '/') as database 0.
            options.pop("connection_class", None)
            if scheme == "rediss":
                options["ssl"] = True
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"{setting}: {masked_url(url)} is not a valid Redis URL ({exc})") from None
    if options.get("ssl") and isinstance(ssl, Mapping):
        for name, value in ssl.items():
            options.setdefault(str(name), value)
    unknown = sorted(name for name in options if name.startswith("ssl_")
                     and name not in SSL_OPTIONS)
    if unknown:
        raise ConfigurationError(f"{setting}: unknown TLS option(s) {', '.join(unknown)} "
                                 f"(known: {', '.join(SSL_OPTIONS)})")
    return _pairs(options)


def _sentinel(parts: list[str], setting: str, transport: dict[str, Any],
              ssl: Mapping[str, Any] | bool | None) -> RedisEndpoint:
    sentinels: list[tuple[str, int]] = []
    first = None
    for part in parts:
        try:
            parsed = url_to_parts(part)
            port = int(parsed.port or 26379)
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"{setting}: {masked_url(part)} is not a valid "
                                     f"sentinel:// URL ({exc})") from None
        if not parsed.hostname:
            raise ConfigurationError(f"{setting}: {masked_url(part)} names no Sentinel host")
        sentinels.append((parsed.hostname, port))
        first = first or parsed
    assert first is not None
    master_name = first.query.get("master_name") or transport.get("master_name")
    if not master_name:
        raise ConfigurationError(
            f"{setting}: a sentinel:// URL needs the transport option master_name "
            "(broker_transport_options={'master_name': ...})")
    options: dict[str, Any] = {}
    try:
        options["db"] = int((first.path or "0").strip("/") or 0)
    except ValueError as exc:
        raise ConfigurationError(
            f"{setting}: {masked_url(parts[0])} has no valid db ({exc})") from None
    if first.username:
        options["username"] = unquote(first.username)
    if first.password:
        options["password"] = unquote(first.password)
    if ssl:
        # kombu's SentinelChannel: SentinelManagedSSLConnection when the broker has SSL.
        options["ssl"] = True
        if isinstance(ssl, Mapping):
            options.update({str(name): value for name, value in ssl.items()})
    sentinel_kwargs = transport.get("sentinel_kwargs") or {}
    if not isinstance(sentinel_kwargs, Mapping):
        raise ConfigurationError(f"{setting}: the transport option sentinel_kwargs must be "
                                 f"a mapping, not {type(sentinel_kwargs).__name__}")
    return RedisEndpoint(_pairs(options), sentinels=tuple(sentinels),
                         master_name=str(master_name),
                         sentinel_kwargs=_pairs(dict(sentinel_kwargs)),
                         min_other_sentinels=int(transport.get("min_other_sentinels") or 0))


def _pairs(options: Mapping[str, Any]) -> Pairs:
    return tuple(sorted((str(name), value) for name, value in options.items()
                        if value is not None))


_PASSWORD_QUERY = re.compile(r"(?i)(password=)[^&;]*")


def masked_url(url: str) -> str:
    """``url`` (each URL of a ``;``-separated list) with its passwords masked,
    in the credentials and in a ``password=`` query option."""
    masked = []
    for part in str(url).split(";"):
        scheme, sep, rest = part.partition("://")
        credentials, at, host = rest.rpartition("@")
        if at and ":" in credentials:
            credentials = credentials.split(":", 1)[0] + ":***"
        masked.append(_PASSWORD_QUERY.sub(r"\1***", f"{scheme}{sep}{credentials}{at}{host}"))
    return ";".join(masked)
