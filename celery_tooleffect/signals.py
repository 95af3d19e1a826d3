"""Signals the package sends, as Celery's ``celery.signals``: connect a receiver
with ``@approval_requested.connect``.

``approval_requested``
    A call that needs a person's approval was parked (its record stored, its
    message about to be acknowledged), in the worker's main process. Sent by
    the tool; ``approval`` is the
    :class:`~celery_tooleffect.store.approvals.Approval` (``task_id``, ``name``,
    ``queue``, ``run_id``, ``arguments`` as ``tooleffect_privacy`` shows them).
    Use it to notify someone. A receiver that raises is logged and ignored
    (Celery's ``Signal.send``), and the call stays parked.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

approval_requested = Signal(name="approval_requested", providing_args={"approval"})

__all__ = ["approval_requested"]
