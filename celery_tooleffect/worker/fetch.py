"""Which fetch an app's Redis broker uses: the package's atomic fetch by default.

An app connects to its broker through ``app.amqp.Connection`` (kombu's
``Connection``; ``Celery._connection`` builds every connection of the app with
it: the worker's consumer, the producer pool, ``celery inspect``). kombu picks
the transport class from the URL's scheme when the connection is first used
(``Connection.get_transport_cls``), and again after a failover list switches
URL. :func:`install_atomic_fetch` gives the app a ``Connection`` subclass whose
``get_transport_cls`` answers the package's transport
(:mod:`celery_tooleffect.worker.transport`) where kombu would answer its own
Redis or Redis Sentinel transport: every URL form (``redis://``,
``rediss://``, ``redis+socket://``, ``unix://``, ``sentinel://``, failover
lists), nothing else. A transport class the app names itself
(``broker_transport``) is left alone, and so is every broker that is not Redis.

The setting ``tooleffect_atomic_fetch = False`` keeps kombu's own fetch; it is
read each time a connection picks its transport.

Which fetch a worker uses shows where Celery shows its broker: the start-up
banner's ``transport`` line and the "Connected to" log line read
``Connection.as_uri()``, which says ``(atomic fetch)`` after the URL. A URI
asked for with its password (to connect with: Flower's broker page) is
kombu's own.
"""

from __future__ import annotations

from typing import Any

from ..settings import atomic_fetch_enabled
from .transport import ATOMIC

#: Set on the app's AMQP object once its Connection class is replaced.
_INSTALLED = "_tooleffect_fetch_installed"


def install_atomic_fetch(app: Any) -> None:
    """Make ``app`` fetch from a Redis broker with the atomic fetch (once per app)."""
    amqp = app.amqp
    if getattr(amqp, _INSTALLED, False):
        return
    base = amqp.Connection

    class ToolConnection(base):  # type: ignore[misc, valid-type]
        """kombu's Connection, with the atomic fetch on a Redis broker."""

        def get_transport_cls(self) -> Any:
            transport = super().get_transport_cls()
            if atomic_fetch_enabled(app.conf):
                return ATOMIC.get(transport, transport)
            return transport

        def as_uri(self, include_password: bool = False, mask: str = "**",
                   **kwargs: Any) -> str:
            uri: str = super().as_uri(include_password, mask, **kwargs)
            if include_password or not uses_atomic_fetch(self):
                return uri
            return f"{uri} (atomic fetch)"

    ToolConnection.__qualname__ = ToolConnection.__name__ = f"{base.__name__}"
    amqp.Connection = ToolConnection
    setattr(amqp, _INSTALLED, True)


def uses_atomic_fetch(connection: Any) -> bool:
    """Whether a kombu connection fetches with the package's atomic fetch."""
    return connection.get_transport_cls() in ATOMIC.values()
