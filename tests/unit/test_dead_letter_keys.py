"""Where the dead letters' keys are: per queue on a single Redis, all in one
slot on a Redis Cluster (a RabbitMQ broker with ``tooleffect_redis_cluster``),
so that each dead-letter script (which writes a letter and its index entries
together) touches one slot."""

from __future__ import annotations

from redis.crc import key_slot

from celery_tooleffect.admin.sizing import DEAD_LETTERS, RUN_STREAMS, classify
from celery_tooleffect.settings import settings_for
from celery_tooleffect.store.dead_letter_queries import facets_of
from celery_tooleffect.store.dead_letter_record import DeadLetter
from celery_tooleffect.store.dead_letters import DeadLetters, dead_letter_keys
from celery_tooleffect.store.keys import Keys
from tests.unit.conftest import app_with


def every_key(keys: Keys, letter: DeadLetter) -> list[str]:
    """The keys the store and remove scripts touch for ``letter``."""
    return [keys.dead_letters(letter.queue), keys.dead_letter_index(letter.queue),
            keys.dead_letter_queues, keys.dead_letter_locations, keys.dead_letter_facets,
            keys.dead_letter_counts, keys.dead_letter_replaying, keys.dead_letter_all,
            *(keys.dead_letter_facet(facet, value) for facet, value in facets_of(letter))]


LETTER = DeadLetter(task_id="t-1", name="tools.write", queue="to{ol}s:eu",
                    reason="interrupted_write", failure_class="unknown",
                    effect="non_idempotent_write")


def test_on_a_cluster_every_dead_letter_key_is_in_one_slot() -> None:
    app = app_with(broker_url="amqp://g@h/v", tooleffect_redis_cluster=True,
                   tooleffect_redis_url="redis://h:7000")
    keys = dead_letter_keys(settings_for(app))
    assert keys.dead_letters_in_one_slot
    names = every_key(keys, LETTER)
    assert len({key_slot(name.encode()) for name in names}) == 1
    assert len(set(names)) == len(names)
    assert all(classify(name, keys.prefix) == DEAD_LETTERS for name in names)
    # A run named "dlq" keeps its own kind.
    assert classify(Keys(keys.prefix).run_events("dlq"), keys.prefix) == RUN_STREAMS
    # The store script's KEYS, as DeadLetters builds them, are in that slot.
    store_keys, _ = DeadLetters(app).store_arguments(LETTER)
    assert {key_slot(name.encode()) for name in store_keys} == {key_slot(names[0].encode())}


def test_on_a_single_redis_the_names_are_as_they_were() -> None:
    keys = dead_letter_keys(settings_for(app_with()))
    assert not keys.dead_letters_in_one_slot
    assert keys.dead_letters("tools") == "tooleffect:{dlq:tools}:envelopes"
    assert keys.dead_letter_index("tools") == "tooleffect:{dlq:tools}:index"
    assert keys.dead_letter_all == "tooleffect:dlq:index"
    assert keys.dead_letter_facet("reason", "x") == "tooleffect:dlq:by:reason:x"
    assert keys.dead_letter_queues == "tooleffect:dlq:queues"

