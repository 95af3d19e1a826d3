"""What the worker reads of its store's durability, and the rollback watch,
on real redis-servers the tests start (issue 37; docs/redis.md#durability).

The fault scenarios (a worker, 400 writes, a killed server) are in
tests/faults/test_durability.py; here the pieces are driven one at a time:
the intent script against a store restarted from an older snapshot, the
start-up checks against a user that may not read CONFIG or INFO, the
``store`` command and Flower's gauges.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from celery_tooleffect import Approvals, DeadLetters
from celery_tooleffect.admin.cli import tooleffect
from celery_tooleffect.admin.flower.metrics import (
    DURABILITY_GAUGE,
    REPLICAS_GAUGE,
    export_store_gauges,
)
from celery_tooleffect.errors import ConfigurationError
from celery_tooleffect.events import AuditEvent
from celery_tooleffect.store.journal import Begin, JournalRef
from celery_tooleffect.store.keys import Keys
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.store.states import Verdict
from celery_tooleffect.testing import redis_server
from celery_tooleffect.worker.startup import run_checks
from tests.support import run_fields

WRITE = "non_idempotent_write"


def begin(app: Celery, task_id: str, *, effect: str = WRITE, sent_at: float | None = None,
          first_delivery: bool = False) -> Begin:
    """One intent of ``task_id`` (a run of its own), as a worker records it."""
    ref = JournalRef(task_id, task_id)
    event = AuditEvent(run_id=task_id, task_id=task_id, tool="tools.write", effect=effect,
                       phase="intent", status="started", worker="test", queue="tools")
    return runtime_for(app).journal.begin_attempt(
        ref, token=f"token-{task_id}", effect=effect, lease_end=time.time() + 30,
        attempts_allowed=3, event=event, tool="tools.write", sent_at=sent_at,
        first_delivery=first_delivery)


def test_a_store_restarted_from_an_older_snapshot_is_found_rolled_back(
        make_app: Callable[..., Celery], prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    with redis_server() as server:
        app = make_app(broker_url=server.url, result_backend=server.url)
        keys = Keys(f"{prefix}te:")
        for task in ("a", "b", "c"):
            assert begin(app, task).verdict is Verdict.STARTED
        server.client().save()  # the snapshot holds three intents of this process
        for task in ("d", "e"):
            assert begin(app, task).verdict is Verdict.STARTED
        published = time.time()
        server.restart()  # SIGKILL, then back from the snapshot: d and e are gone
        assert server.client().exists(keys.journal("d", "d")) == 0

        # A write published before it was found, with no entry: not run blind.
        found = begin(app, "d", sent_at=published)
        assert (found.verdict, found.detail, found.rolled_back) == (
            Verdict.INTERRUPTED, "store_rolled_back", True)
        mark = {k.decode(): v.decode() for k, v in server.client().hgetall(keys.rollback).items()}
        assert (mark["acknowledged"], mark["found"]) == ("5", "3"), mark
        assert "holds fewer intents than it acknowledged to this process" in caplog.text
        journal = runtime_for(app).journal.read(JournalRef("d", "d"))
        assert (journal["state"], journal["interrupted_by"]) == ("interrupted",
                                                                 "store_rolled_back")
        events = run_fields(server.client(), keys.run_events("d"))
        assert [(e[b"phase"], e[b"status"]) for e in events] == [
            (b"interrupted", b"store_rolled_back")]

        # Found once: the next call finds no new rollback, and the mark stays.
        detected_at = mark["detected_at"]
        unknown = begin(app, "f")  # no send time: counts as published before
        assert (unknown.verdict, unknown.detail, unknown.rolled_back) == (
            Verdict.INTERRUPTED, "store_rolled_back", False)
        assert server.client().hget(keys.rollback, "detected_at").decode() == detected_at
        # Published after it was found; delivered for the first time by a
        # broker that was not rolled back; an idempotent write: they run.
        assert begin(app, "g", sent_at=time.time() + 1).verdict is Verdict.STARTED
        assert begin(app, "h", sent_at=published, first_delivery=True).verdict is Verdict.STARTED
        assert begin(app, "i", effect="idempotent_write").verdict is Verdict.STARTED
        assert caplog.text.count("holds fewer intents") == 1

        # What the operator sees.
        shown = invoke(app, "store", "--json")
        assert shown.exit_code == 0, shown.output
        rollback = json.loads(shown.stdout)["rollback"]
        assert (rollback["acknowledged"], rollback["found"]) == (5, 3)
        said = invoke(app, "store").stdout
        assert "Rollbacks: last found" in said and "held 3 of the 5 intents" in said


def test_a_store_that_was_not_rolled_back_is_trusted(
        make_app: Callable[..., Celery], prefix: str) -> None:
    with redis_server("--appendonly", "yes", "--appendfsync", "always") as server:
        app = make_app(broker_url=server.url, result_backend=server.url)
        for task in ("a", "b"):
            assert begin(app, task).verdict is Verdict.STARTED
        server.restart()  # AOF always: nothing lost
        after = begin(app, "c", sent_at=time.time() - 60)
        assert (after.verdict, after.rolled_back) == (Verdict.STARTED, False)
        assert server.client().exists(Keys(f"{prefix}te:").rollback) == 0
        assert "Rollbacks: none found." in invoke(app, "store").stdout


def test_persistence_that_cannot_be_read_refuses_the_start(
        make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture) -> None:
    with redis_server("--appendonly", "yes") as server:
        server.client().execute_command(
            "ACL", "SETUSER", "worker", "on", ">pw", "~*", "&*", "+@all", "-config", "-info")
        url = f"redis://worker:pw@127.0.0.1:{server.port}/0"
        with pytest.raises(ConfigurationError) as refused:
            run_checks(make_app(broker_url=url, result_backend=url,
                                tooleffect_allow_volatile_store=False))
        said = str(refused.value)
        assert ("could not read whether the journal and audit store and the dead-letter store "
                f"(127.0.0.1:{server.port}) keeps its writes across a restart") in said
        assert "CONFIG GET: NoPermissionError" in said and "INFO persistence:" in said
        assert "or set tooleffect_allow_volatile_store = True to accept the risk" in said
        # The opt-out makes it a warning.
        run_checks(make_app(broker_url=url, result_backend=url))
        assert "started because tooleffect_allow_volatile_store is True" in caplog.text


def test_the_store_command_and_the_gauges_say_the_mode(
        make_app: Callable[..., Celery]) -> None:
    with redis_server(appendonly=True) as store, redis_server() as broker:
        app = make_app(broker_url=broker.url, result_backend=broker.url,
                       tooleffect_redis_url=store.url)
        listed = json.loads(invoke(app, "store", "--json").stdout)
        modes = {tuple(row["roles"]): row["mode"] for row in listed["servers"]}
        assert modes == {("journal",): "aof_everysec", ("dead_letters",): "none"}
        assert listed["replicas"] == {"in_sync": 0, "wanted": 0, "fsync": False}
        table = invoke(app, "store", width=120).stdout
        assert "AOF, appendfsync everysec" in table and "up to 1 s of writes" in table
        assert "no AOF and no RDB snapshots" in table and "everything" in table

        registry = CollectorRegistry()
        export_store_gauges(Approvals(app), DeadLetters(app), registry=registry)
        families = {family.name: family for family in
                    text_string_to_metric_families(generate_latest(registry).decode())}
        samples = {(s.labels["store"], s.labels["mode"]): s.value
                   for s in families[DURABILITY_GAUGE].samples}
        assert samples == {("journal", "aof_everysec"): 1.0, ("dead_letters", "none"): 1.0}
        assert [s.value for s in families[REPLICAS_GAUGE].samples] == [0.0]


def invoke(app: Celery, *args: str, width: int = 80) -> Result:
    return CliRunner().invoke(tooleffect, list(args),
                              obj=CLIContext(app=app, no_color=True, workdir=None),
                              env={"COLUMNS": str(width)})
