"""When unresolved dead letters are warned about (a worker at start, Flower's
Dead letters page): the pure decision of
:func:`celery_tooleffect.store.dead_letter_queries.backlog_warnings`."""

from __future__ import annotations

import dataclasses

from celery_tooleffect.settings import settings_for
from celery_tooleffect.store.dead_letter_queries import QueueBacklog, backlog_warnings
from tests.unit.conftest import app_with

NOW = 1_800_000_000.0
SETTINGS = dataclasses.replace(settings_for(app_with()), dead_letter_warn_count=10,
                               dead_letter_warn_age=3600.0)


def test_nothing_is_said_at_or_below_both_thresholds() -> None:
    backlog = {"tools": QueueBacklog("tools", 10, NOW - 3600)}
    assert backlog_warnings(backlog, SETTINGS, NOW) == []
    assert backlog_warnings({}, SETTINGS, NOW) == []


def test_a_queue_past_the_count_or_the_age_is_named_with_both_figures() -> None:
    backlog = {
        "reports": QueueBacklog("reports", 11, NOW - 60),
        "tools": QueueBacklog("tools", 2, NOW - 3 * 86400 - 5),
        "quiet": QueueBacklog("quiet", 1, NOW - 10),
        "both": QueueBacklog("both", 500, NOW - 7200),
    }
    assert backlog_warnings(backlog, SETTINGS, NOW) == [
        "queue 'both' holds 500 unresolved dead letter(s), the oldest stored 2h ago: more "
        "than tooleffect_dead_letter_warn_count (10) and older than "
        "tooleffect_dead_letter_warn_age (3600s); replay or purge them "
        "(celery tooleffect dlq list -Q both)",
        "queue 'reports' holds 11 unresolved dead letter(s), the oldest stored 1m ago: more "
        "than tooleffect_dead_letter_warn_count (10); replay or purge them "
        "(celery tooleffect dlq list -Q reports)",
        "queue 'tools' holds 2 unresolved dead letter(s), the oldest stored 3d ago: older "
        "than tooleffect_dead_letter_warn_age (3600s); replay or purge them "
        "(celery tooleffect dlq list -Q tools)",
    ]


def test_a_zero_threshold_warns_about_any_letter() -> None:
    strict = dataclasses.replace(SETTINGS, dead_letter_warn_count=0)
    assert len(backlog_warnings({"q": QueueBacklog("q", 1, NOW)}, strict, NOW)) == 1
    # A clock behind the store's: the age is never negative.
    assert backlog_warnings({"q": QueueBacklog("q", 1, NOW + 50)}, SETTINGS, NOW) == []
