"""Publishing a kept message again: the one way a call that was held back
(a dead letter an operator replays, a call a person approved or rejected)
goes back to its queue.

Called by a replay (``admin/operations/replay.py``) and by an approval
decision (:mod:`.approving`, from the CLI, Flower or the worker's sweep). It
is not in ``store/``, which talks to Redis only, never to the broker.
"""

from __future__ import annotations

from typing import Any

from ..store.envelope import MessageEnvelope


def republish(app: Any, message: MessageEnvelope, queue: str) -> None:
    """Publish ``message`` with ``app``'s producer, exactly as the envelope says (its
    body, headers and properties, to its exchange and routing key), declaring
    ``app``'s queue named ``queue`` first when the app knows it."""
    declared = app.amqp.queues.get(queue)
    with app.producer_or_acquire() as producer:
        message.publish(producer, declare=[declared] if declared is not None else [])
