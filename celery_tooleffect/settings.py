"""The package's settings: Celery settings prefixed ``tooleffect_``, read here only.

Every setting is documented in the README's settings table. An unknown
``tooleffect_*`` key is an error: a misspelt setting must not silently fall
back to a default, and no setting may relabel a tool's effect.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import math
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from os import PathLike
from typing import TYPE_CHECKING, Any

from .endpoints import RedisEndpoint, is_redis_family, resolve
from .errors import ConfigurationError

if TYPE_CHECKING:
    from celery import Celery

PREFIX = "tooleffect_"
PRIVACY_LEVELS = ("metadata", "redacted", "full")
#: The store of an app whose broker is not Redis (RabbitMQ) and that names none.
DEFAULT_STORE_URL = "redis://127.0.0.1:6379/0"

DEFAULTS: dict[str, Any] = {
    "tooleffect_redis_url": None,
    "tooleffect_redis_cluster": False,
    "tooleffect_key_prefix": "tooleffect:",
    "tooleffect_max_retries": 3,
    "tooleffect_backoff_base": 30.0,
    "tooleffect_backoff_cap": 600.0,
    "tooleffect_privacy": "metadata",
    "tooleffect_retention": 7 * 24 * 3600,
    "tooleffect_run_stream_maxlen": 10_000,
    "tooleffect_global_stream_maxlen": 100_000,
    "tooleffect_failure_classes": {},
    "tooleffect_socket_timeout": 5.0,
    "tooleffect_heartbeat_interval": None,
    "tooleffect_rabbitmq_consumer_timeout": 1800.0,
    "tooleffect_reconcile_timeout": 30.0,
    "tooleffect_approval_timeout": 24 * 3600.0,
    # Seconds a decided approval stays listed (approvals list --state ...).
    "tooleffect_approval_retention": 7 * 24 * 3600.0,
    "tooleffect_allow_eviction": False,
    # Start on a store that can lose acknowledged writes when its process
    # restarts (no AOF, no replicas waited for): docs/redis.md#durability.
    "tooleffect_allow_volatile_store": False,
    # None: 1 when the store is behind Sentinel (it fails over), else 0.
    "tooleffect_store_replicas": None,
    "tooleffect_store_fsync": False,
    "tooleffect_store_wait_timeout": 1.0,
    # None: the version of the app's distribution, if found (default_release).
    "tooleffect_release": None,
    # On a Redis broker, take a message and record it unacknowledged in one
    # script (celery_tooleffect.worker.transport); False keeps kombu's fetch.
    "tooleffect_atomic_fetch": True,
    # Agents (celery_tooleffect.agents): how long a call is waited for before
    # the agent is told it awaits approval / is still running, the largest
    # arguments a call takes, the largest result text the model receives, and
    # the MCP server's bearer token and trusted Host / Origin values over HTTP.
    "tooleffect_agent_approval_wait": 30.0,
    "tooleffect_agent_result_wait": 300.0,
    "tooleffect_agent_max_argument_bytes": 256 * 1024,
    "tooleffect_agent_max_result_bytes": 32 * 1024,
    # The MCP server answers a call that has not ended within this many seconds
    # with its status: below the 60 s default request timeout of the MCP
    # TypeScript SDK's client, so that such a client is told, not timed out.
    "tooleffect_mcp_result_wait": 50.0,
    "tooleffect_mcp_token": None,
    "tooleffect_mcp_allowed_hosts": (),
    "tooleffect_mcp_allowed_origins": (),
    # The MCP server as an OAuth 2.1 resource server (agents/oauth.py): the
    # issuer whose access tokens it accepts, their audience, and how it checks
    # them (the issuer's keys, or its introspection endpoint and the server's
    # client credentials there); its own URL for RFC 9728 metadata; and
    # whether a call also needs the scope tool:<name>.
    "tooleffect_mcp_oauth_issuer": None,
    "tooleffect_mcp_oauth_audience": None,
    "tooleffect_mcp_oauth_jwks_url": None,
    "tooleffect_mcp_oauth_introspection_url": None,
    "tooleffect_mcp_oauth_client_id": None,
    "tooleffect_mcp_oauth_client_secret": None,
    "tooleffect_mcp_oauth_resource_url": None,
    "tooleffect_mcp_oauth_tool_scopes": False,
    # Flower's /metrics, with the package's gauges in it, asks for Flower's
    # authentication (--basic-auth, --auth) when Flower has one.
    "tooleffect_flower_metrics_auth": True,
    # Unresolved dead letters: a worker at start and Flower's Dead letters page
    # warn when a queue holds more than this many, or one older than this
    # many seconds (docs/operations.md#dead-letters-waiting).
    "tooleffect_dead_letter_warn_count": 100,
    "tooleffect_dead_letter_warn_age": 24 * 3600.0,
    # The secret every audit event's MAC is computed with (docs/operations.md#
    # audit-verify): the key itself, or a file holding it; never both.
    "tooleffect_audit_key": None,
    "tooleffect_audit_key_file": None,
}
#: The shortest audit key accepted, in bytes.
AUDIT_KEY_MINIMUM = 16


@dataclass(frozen=True)
class Settings:
    """The resolved settings of one app."""

    redis_url: str
    broker_url: str
    dead_letter_url: str
    key_prefix: str
    max_retries: int
    backoff_base: float
    backoff_cap: float
    privacy: str
    retention: int
    run_stream_maxlen: int
    global_stream_maxlen: int
    failure_classes: Mapping[str, str]
    socket_timeout: float
    broker_is_redis: bool
    visibility_timeout: float
    heartbeat_interval: float | None
    rabbitmq_consumer_timeout: float
    #: Seconds a tool's ``reconcile`` may take before its answer counts as unknown.
    reconcile_timeout: float = 30.0
    #: Seconds a call may wait for approval before it is rejected as expired.
    approval_timeout: float = 24 * 3600.0
    #: Seconds a decided approval stays listed by its decision
    #: (``tooleffect_approval_retention``), and at least how long its record lives.
    approval_retention: float = 7 * 24 * 3600.0
    broker_transport_options: Mapping[str, Any] = field(default_factory=dict)
    #: The store (``redis_url``) is a Redis Cluster (``tooleffect_redis_cluster``).
    redis_cluster: bool = False
    #: Celery's ``task_default_queue``: the queue of a message that names none.
    default_queue: str = "celery"
    #: Where the journal and audit (``redis_url``), the dead letters
    #: (``dead_letter_url``) and, on a Redis broker, the broker's messages are.
    store: RedisEndpoint | None = None
    dead_letter_store: RedisEndpoint | None = None
    broker_redis: RedisEndpoint | None = None
    #: Start even on a store whose ``maxmemory-policy`` can evict the package's keys.
    allow_eviction: bool = False
    #: Start even on a store (or dead-letter store) that can lose what it
    #: acknowledged when its process restarts (``tooleffect_allow_volatile_store``).
    allow_volatile_store: bool = False
    #: Replicas that must hold a write's intent before its body runs (``WAIT``),
    #: and whether it must be fsynced to the store's AOF too (``WAITAOF``).
    store_replicas: int = 0
    store_fsync: bool = False
    #: Seconds WAIT / WAITAOF may block before the intent counts as not durable.
    store_wait_timeout: float = 1.0
    #: The release of the code the workers run (``tooleffect_release``), published
    #: with the effects a worker declares ('' when unknown).
    release: str = ""
    #: The broker is Redis and its messages are fetched by the package's atomic
    #: fetch (``tooleffect_atomic_fetch``, on by default).
    atomic_fetch: bool = False
    #: Seconds an agent's call parked for approval is waited for before the
    #: agent is told it awaits approval (``tooleffect_agent_approval_wait``).
    agent_approval_wait: float = 30.0
    #: Seconds any other agent call is waited for before the agent is told it
    #: is still queued or running (``tooleffect_agent_result_wait``).
    agent_result_wait: float = 300.0
    #: The largest arguments of an agent's call, as JSON bytes.
    agent_max_argument_bytes: int = 256 * 1024
    #: The largest result text (UTF-8 bytes) an agent's model receives; a
    #: longer one is cut with a note (``tooleffect_agent_max_result_bytes``).
    agent_max_result_bytes: int = 32 * 1024
    #: Seconds the MCP server waits for a call before it answers that the call
    #: is still queued or running (``tooleffect_mcp_result_wait``): below the
    #: 60 s default request timeout of the MCP TypeScript SDK's client.
    mcp_result_wait: float = 50.0
    #: The bearer token the MCP server asks of HTTP clients (None: none set).
    mcp_token: str | None = field(default=None, repr=False)
    #: The ``Host`` and ``Origin`` values the MCP server's HTTP transport
    #: accepts besides this machine's own (``tooleffect_mcp_allowed_hosts``,
    #: ``tooleffect_mcp_allowed_origins``; ``name:*`` for any port).
    mcp_allowed_hosts: tuple[str, ...] = ()
    mcp_allowed_origins: tuple[str, ...] = ()
    #: The issuer whose access tokens the MCP server accepts (None: no OAuth),
    #: their audience, the issuer's keys (JWKS) or introspection endpoint, the
    #: server's client credentials there, the server's own URL (RFC 9728) and
    #: whether a call needs ``tool:<name>`` too (``tooleffect_mcp_oauth_*``).
    mcp_oauth_issuer: str | None = None
    mcp_oauth_audience: str | None = None
    mcp_oauth_jwks_url: str | None = None
    mcp_oauth_introspection_url: str | None = None
    mcp_oauth_client_id: str | None = None
    mcp_oauth_client_secret: str | None = field(default=None, repr=False)
    mcp_oauth_resource_url: str | None = None
    mcp_oauth_tool_scopes: bool = False
    #: Flower's ``/metrics`` asks for Flower's authentication, when it has one
    #: (``tooleffect_flower_metrics_auth``; False: it answers anyone, as Flower's own).
    flower_metrics_auth: bool = True
    #: A queue with more unresolved dead letters than this is warned about
    #: (``tooleffect_dead_letter_warn_count``).
    dead_letter_warn_count: int = 100
    #: A queue whose oldest unresolved dead letter is older than this many
    #: seconds is warned about (``tooleffect_dead_letter_warn_age``).
    dead_letter_warn_age: float = 24 * 3600.0
    #: The key of the audit events' MACs (``tooleffect_audit_key`` or the
    #: content of ``tooleffect_audit_key_file``); None: events are not keyed.
    audit_key: bytes | None = field(default=None, repr=False)

    @cached_property
    def store_endpoint(self) -> RedisEndpoint:
        """:attr:`store`, resolved from :attr:`redis_url` for hand-made settings."""
        return self.store or resolve(self.redis_url, setting="tooleffect_redis_url",
                                     cluster=self.redis_cluster)

    @property
    def dead_letter_endpoint(self) -> RedisEndpoint:
        """:attr:`dead_letter_store`, resolved from :attr:`dead_letter_url` likewise."""
        return self.dead_letter_store or resolve(
            self.dead_letter_url, setting="broker_url",
            cluster=self.redis_cluster and self.dead_letter_url == self.redis_url)

    @cached_property
    def broker_rolls_back_with_store(self) -> bool:
        """Whether the broker is a Redis on the store's server (any database): a
        rollback of the store then rolls the queues back with it, so a message
        that ran before the rollback comes back as if never delivered."""
        broker = self.broker_redis
        return broker is not None and (
            self.redis_cluster or broker.server() == self.store_endpoint.server())

    def backoff(self, retries: int) -> float:
        """Seconds to wait before retry number ``retries + 1``."""
        return float(min(self.backoff_base * (2**retries), self.backoff_cap))

    @property
    def journal_minimum(self) -> int:
        """The shortest retention the journal allows: past any redelivery of a
        message (``visibility_timeout * (max_retries + 2)``) and its retries'
        waits (``backoff_cap * max_retries``), in whole seconds."""
        redeliveries = self.visibility_timeout * (self.max_retries + 2)
        return math.ceil(redeliveries + self.backoff_cap * self.max_retries)

    @cached_property
    def journal_ttl(self) -> int:
        """How long a journal entry lives: past any redelivery of its message."""
        redeliveries = self.visibility_timeout * (self.max_retries + 2)
        return int(max(self.retention, redeliveries + self.backoff_cap * self.max_retries))

    @property
    def approval_ttl(self) -> int:
        """How long an approval record lives: its timeout, then as long as a journal
        entry or as long as a decision stays listed (``approval_retention``),
        whichever is longer."""
        return int(self.approval_timeout) + max(self.journal_ttl,
                                                math.ceil(self.approval_retention))


_cache: weakref.WeakKeyDictionary[Any, Settings] = weakref.WeakKeyDictionary()


def settings_for(app: Celery) -> Settings:
    """The settings of ``app``, read and validated once."""
    cached = _cache.get(app)
    if cached is None:
        cached = _read(app)
        _cache[app] = cached
    return cached


def refuse_unknown_settings(conf: Mapping[str, Any]) -> None:
    """Raise when ``conf`` holds a ``tooleffect_*`` key this package does not know."""
    unknown = sorted(
        key
        for key in conf
        if isinstance(key, str) and key.lower().startswith(PREFIX) and key.lower() not in DEFAULTS
    )
    if unknown:
        raise ConfigurationError(unknown_settings_message(unknown))


def unknown_settings_message(unknown: list[str]) -> str:
    """What an app with the ``unknown`` settings is told: each with the setting
    it most likely meant ("did you mean ..."), the settings' list only when one
    has no close match, and the word on effects only for a key that names one."""
    named = []
    unmatched = False
    for key in unknown:
        close = difflib.get_close_matches(key.lower(), DEFAULTS, n=1, cutoff=0.75)
        named.append(f"{key} (did you mean {close[0]}?)" if close else key)
        unmatched = unmatched or not close
    message = f"unknown setting(s) {', '.join(named)}"
    if unmatched:
        message += f": celery-tooleffect settings are {', '.join(sorted(DEFAULTS))}"
    else:
        message += ": every setting is listed in docs/configuration.md"
    if any("effect" in key.lower()[len(PREFIX):] for key in unknown):
        message += "; a tool's effect is declared in code (effect=...) and cannot be configured"
    return message


def _read(app: Celery) -> Settings:
    conf = app.conf
    refuse_unknown_settings(conf)

    def get(key: str) -> Any:
        value = conf.get(key)
        return DEFAULTS[key] if value is None else value

    broker_url = str(conf.broker_url or app.connection_for_write().as_uri(include_password=True))
    broker_is_redis = is_redis_family(broker_url)
    transport_options = dict(conf.broker_transport_options or {})
    redis_cluster = bool(get("tooleffect_redis_cluster"))
    # A broker that is not Redis (RabbitMQ) with a cluster store: the dead
    # letters are kept in the cluster, every dead-letter key in one slot
    # (store/keys.py, ``dead_letters_in_one_slot``).
    if redis_cluster and not conf.get("tooleffect_redis_url"):
        raise ConfigurationError(
            "tooleffect_redis_cluster needs tooleffect_redis_url (a node of the cluster): "
            "the broker's Redis cannot be a cluster"
        )
    broker_redis = resolve(broker_url, setting="broker_url", transport_options=transport_options,
                           ssl=conf.broker_use_ssl) if broker_is_redis else None
    named = conf.get("tooleffect_redis_url")
    if named:
        # A store of its own: its URL's TLS options, completed by the result
        # backend's (Celery's redis_backend_use_ssl); behind Sentinel, the
        # master name of its query or else the broker's transport options.
        store = resolve(str(named), setting="tooleffect_redis_url",
                        transport_options=transport_options,
                        ssl=conf.get("redis_backend_use_ssl"), cluster=redis_cluster)
    else:
        # The store follows the broker (behind Sentinel: its current master);
        # only a broker that is not Redis leaves it to the default server.
        store = broker_redis or resolve(DEFAULT_STORE_URL, setting="tooleffect_redis_url")
    redis_url = str(named or (broker_url if broker_redis else DEFAULT_STORE_URL))
    replicas, fsync, wait_timeout = _durability(conf, get, store)
    max_retries = _whole(get, "tooleffect_max_retries", 0)
    privacy = str(get("tooleffect_privacy")).lower()
    if privacy not in PRIVACY_LEVELS:
        raise ConfigurationError(
            f"tooleffect_privacy must be one of {PRIVACY_LEVELS}, not {privacy!r}"
        )
    resolved = Settings(
        redis_url=redis_url,
        broker_url=broker_url,
        dead_letter_url=broker_url if broker_is_redis else str(redis_url),
        key_prefix=str(get("tooleffect_key_prefix")),
        max_retries=max_retries,
        backoff_base=_seconds(get, "tooleffect_backoff_base"),
        backoff_cap=_seconds(get, "tooleffect_backoff_cap"),
        privacy=privacy,
        retention=0,  # checked against the journal's minimum below
        run_stream_maxlen=_whole(get, "tooleffect_run_stream_maxlen", 1),
        global_stream_maxlen=_whole(get, "tooleffect_global_stream_maxlen", 1),
        failure_classes=dict(get("tooleffect_failure_classes")),
        socket_timeout=_above_zero(get, "tooleffect_socket_timeout"),
        broker_is_redis=broker_is_redis,
        visibility_timeout=float(transport_options.get("visibility_timeout", 3600)),
        heartbeat_interval=(
            _above_zero(get, "tooleffect_heartbeat_interval")
            if conf.get("tooleffect_heartbeat_interval") else None
        ),
        rabbitmq_consumer_timeout=_above_zero(get, "tooleffect_rabbitmq_consumer_timeout"),
        reconcile_timeout=_above_zero(get, "tooleffect_reconcile_timeout"),
        approval_timeout=_seconds(get, "tooleffect_approval_timeout"),
        approval_retention=_seconds(get, "tooleffect_approval_retention"),
        broker_transport_options=transport_options,
        redis_cluster=redis_cluster,
        default_queue=str(conf.task_default_queue or "celery"),
        store=store,
        dead_letter_store=broker_redis or store,
        broker_redis=broker_redis,
        allow_eviction=bool(get("tooleffect_allow_eviction")),
        allow_volatile_store=_flag(get, "tooleffect_allow_volatile_store"),
        store_replicas=replicas,
        store_fsync=fsync,
        store_wait_timeout=wait_timeout,
        release=(default_release(app) if conf.get("tooleffect_release") is None
                 else str(conf.get("tooleffect_release"))),
        atomic_fetch=broker_is_redis and atomic_fetch_enabled(conf),
        agent_approval_wait=_seconds(get, "tooleffect_agent_approval_wait"),
        agent_result_wait=_seconds(get, "tooleffect_agent_result_wait"),
        agent_max_argument_bytes=_whole(get, "tooleffect_agent_max_argument_bytes", 1),
        agent_max_result_bytes=_positive(get, "tooleffect_agent_max_result_bytes"),
        mcp_result_wait=_seconds(get, "tooleffect_mcp_result_wait"),
        mcp_token=(str(conf["tooleffect_mcp_token"]) if conf.get("tooleffect_mcp_token")
                   else None),
        mcp_allowed_hosts=_names(get, "tooleffect_mcp_allowed_hosts"),
        mcp_allowed_origins=_names(get, "tooleffect_mcp_allowed_origins"),
        mcp_oauth_issuer=_text_or_none(conf, "tooleffect_mcp_oauth_issuer"),
        mcp_oauth_audience=_text_or_none(conf, "tooleffect_mcp_oauth_audience"),
        mcp_oauth_jwks_url=_text_or_none(conf, "tooleffect_mcp_oauth_jwks_url"),
        mcp_oauth_introspection_url=_text_or_none(conf, "tooleffect_mcp_oauth_introspection_url"),
        mcp_oauth_client_id=_text_or_none(conf, "tooleffect_mcp_oauth_client_id"),
        mcp_oauth_client_secret=_text_or_none(conf, "tooleffect_mcp_oauth_client_secret"),
        mcp_oauth_resource_url=_text_or_none(conf, "tooleffect_mcp_oauth_resource_url"),
        mcp_oauth_tool_scopes=_flag(get, "tooleffect_mcp_oauth_tool_scopes"),
        flower_metrics_auth=_flag(get, "tooleffect_flower_metrics_auth"),
        dead_letter_warn_count=_count(get, "tooleffect_dead_letter_warn_count"),
        dead_letter_warn_age=_seconds(get, "tooleffect_dead_letter_warn_age"),
        audit_key=audit_key(conf),
    )
    retention = _retention(resolved, conf.get("tooleffect_retention"))
    return dataclasses.replace(resolved, retention=retention)


def _retention(resolved: Settings, value: Any) -> int:
    """``tooleffect_retention``: seconds, at least the journal's minimum
    (:attr:`Settings.journal_minimum`), which the other settings of
    ``resolved`` make: an entry must outlive every redelivery of its message.
    ``value`` None (not set): the default or that minimum, whichever is longer."""
    minimum = resolved.journal_minimum
    if value is None:
        # Not set: the default grows with a long visibility timeout instead.
        return max(int(DEFAULTS["tooleffect_retention"]), minimum)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            minimum <= value < float("inf")):
        raise ConfigurationError(
            f"tooleffect_retention must be a number of seconds, {minimum} or more (the "
            f"journal's minimum: visibility_timeout x (max_retries + 2) + backoff_cap x "
            f"max_retries), not {value!r}")
    return int(value)


def audit_key(conf: Mapping[str, Any]) -> bytes | None:
    """``tooleffect_audit_key`` (text or bytes) or the content of
    ``tooleffect_audit_key_file`` (trailing whitespace left out): at least
    :data:`AUDIT_KEY_MINIMUM` bytes. None when neither is set."""
    named, path = conf.get("tooleffect_audit_key"), conf.get("tooleffect_audit_key_file")
    if named is not None and path is not None:
        raise ConfigurationError(
            "tooleffect_audit_key and tooleffect_audit_key_file are both set: give one")
    setting, value = "tooleffect_audit_key", named
    if path is not None:
        setting = "tooleffect_audit_key_file"
        if not isinstance(path, (str, PathLike)) or not str(path):
            raise ConfigurationError(
                f"tooleffect_audit_key_file must be the path of a file, not {path!r}")
        try:
            with open(path, "rb") as source:
                value = source.read().rstrip()
        except OSError as exc:
            raise ConfigurationError(
                f"tooleffect_audit_key_file {str(path)!r} cannot be read: "
                f"{exc.strerror or exc}") from exc
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, bytes):
        raise ConfigurationError(
            f"{setting} must be a secret (text or bytes), not a {type(value).__name__}")
    if len(value) < AUDIT_KEY_MINIMUM:
        # The key itself is never shown.
        raise ConfigurationError(
            f"{setting} must be at least {AUDIT_KEY_MINIMUM} bytes (e.g. "
            f"secrets.token_hex(32)), not {len(value)}")
    return value


def _whole(get: Any, key: str, minimum: int) -> int:
    """Setting ``key``: a whole number (or its text), ``minimum`` or more."""
    value = get(key)
    try:
        number = (int(value) if isinstance(value, (int, str))
                  else int(value) if isinstance(value, float) and value.is_integer() else None)
    except ValueError:
        number = None
    if isinstance(value, bool) or number is None or number < minimum:
        raise ConfigurationError(
            f"{key} must be a whole number, {minimum} or more, not {value!r}")
    return number


def _above_zero(get: Any, key: str) -> float:
    """Setting ``key``: a number of seconds above 0."""
    value = get(key)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = 0.0
    if isinstance(value, bool) or not 0 < seconds < float("inf"):
        raise ConfigurationError(
            f"{key} must be a number of seconds above 0, not {value!r}")
    return seconds


def _count(get: Any, key: str) -> int:
    """Setting ``key``: a whole number, 0 or more."""
    value = get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{key} must be a whole number, 0 or more, not {value!r}")
    return value


def _positive(get: Any, key: str) -> int:
    """Setting ``key``: a whole number, 1 or more."""
    value = get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{key} must be a whole number, 1 or more, not {value!r}")
    return value


def _names(get: Any, key: str) -> tuple[str, ...]:
    """Setting ``key``: a list of non-empty strings (a single string is one)."""
    value = get(key)
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(
            isinstance(name, str) and name.strip() for name in names):
        raise ConfigurationError(f"{key} must be a list of names, not {value!r}")
    return tuple(name.strip() for name in names)


def _text_or_none(conf: Mapping[str, Any], key: str) -> str | None:
    """Setting ``key``: a non-empty text, or None when it is not set or empty."""
    value = conf.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigurationError(f"{key} must be text, not {value!r}")
    return value.strip() or None


def _flag(get: Any, key: str) -> bool:
    """Setting ``key``: True or False."""
    value = get(key)
    if not isinstance(value, bool):
        raise ConfigurationError(f"{key} must be True or False, not {value!r}")
    return value


def _seconds(get: Any, key: str) -> float:
    """Setting ``key``: a number of seconds, 0 or more."""
    value = get(key)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not 0 <= seconds < float("inf"):
        raise ConfigurationError(f"{key} must be a number of seconds, 0 or more, not {value!r}")
    return seconds


def atomic_fetch_enabled(conf: Mapping[str, Any]) -> bool:
    """``tooleffect_atomic_fetch``: whether a Redis broker's messages are fetched
    by the package's atomic fetch (True unless set to False)."""
    value = conf.get("tooleffect_atomic_fetch")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ConfigurationError(
            f"tooleffect_atomic_fetch must be True or False, not {value!r}")
    return value


def default_release(app: Celery) -> str:
    """The release of ``app``'s code when ``tooleffect_release`` is not set: the
    version of the installed distribution named like the top-level package of
    the app's main module (``Celery("agent.tasks")``: distribution ``agent``),
    else that package's ``__version__`` when it is imported, else ''."""
    top = str(app.main or "").split(".")[0]
    if not top or top == "__main__":
        return ""
    try:
        return importlib.metadata.version(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        pass
    version = getattr(sys.modules.get(top), "__version__", None)
    return version if isinstance(version, str) else ""


def _durability(conf: Any, get: Any, store: RedisEndpoint) -> tuple[int, bool, float]:
    """``tooleffect_store_replicas``, ``_fsync`` and ``_wait_timeout``, checked."""
    named = conf.get("tooleffect_store_replicas")
    replicas = (1 if store.behind_sentinel else 0) if named is None else named
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ConfigurationError(
            f"tooleffect_store_replicas must be a whole number of replicas (0 or more), "
            f"not {replicas!r}")
    fsync = bool(get("tooleffect_store_fsync"))
    wait_timeout = _seconds(get, "tooleffect_store_wait_timeout")
    socket_timeout = _above_zero(get, "tooleffect_socket_timeout")
    if (replicas or fsync) and not 0 < wait_timeout < socket_timeout:
        raise ConfigurationError(
            f"tooleffect_store_wait_timeout ({wait_timeout:g}s) must be above 0 and below "
            f"tooleffect_socket_timeout ({socket_timeout:g}s): WAIT blocks the connection")
    if (replicas or fsync) and store.cluster:
        raise ConfigurationError(
            "tooleffect_store_replicas and tooleffect_store_fsync are not supported on a "
            "Redis Cluster store (tooleffect_redis_cluster)")
    return replicas, fsync, wait_timeout
