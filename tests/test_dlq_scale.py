"""Paging and counts stay fast with 100,000 dead letters: no listing, show or count scans.

The letters are written with pipelines (the package's own store script, by
the benchmark's ``fill_dead_letters``) into a
redis-server of the test's own, so that Redis's command statistics count only
what the package sends: a page of 50 and the stats must cost a number of
commands that does not grow with the number of dead letters. The CLI is then
timed as a real process (``celery -A ... tooleffect dlq list --limit 50`` and
``dlq stats``). Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from bench.store_scale import fill_dead_letters, varied_letters
from celery_tooleffect.store.dead_letter_queries import DeadLetterQuery
from celery_tooleffect.store.dead_letters import DeadLetters
from tests.conftest import TESTS, RedisServer, app_config

N = 100_000

#: Filling 100,000 letters and timing the CLI three times a command takes
#: about 40 s alone and passed pytest's default 120 s beside a loaded suite.
pytestmark = pytest.mark.timeout(300)


def commands(client: redis.Redis) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return sum(int(entry["calls"]) for name, entry in stats.items()
               if name not in ("cmdstat_info", "cmdstat_config|resetstat"))


def measured(client: redis.Redis, action: Any) -> tuple[Any, float, int]:
    client.config_resetstat()
    started = time.perf_counter()
    value = action()
    return value, time.perf_counter() - started, commands(client)


def cli(env: dict[str, str], *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    best = float("inf")
    done: subprocess.CompletedProcess[str] | None = None
    for _ in range(3):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.apps.tool_app", "tooleffect", *args],
            env=env, cwd=str(TESTS.parent), capture_output=True, text=True, timeout=120,
            check=False,
        )
        best = min(best, time.perf_counter() - started)
        assert done.returncode == 0, done.stderr
    assert done is not None
    return best, done


def test_paging_and_counts_with_100000_dead_letters(second_redis: RedisServer) -> None:
    prefix = f"scale:{uuid.uuid4().hex[:8]}:"
    app = Celery("scale", set_as_current=False)
    app.conf.update(app_config(prefix, broker_url=second_redis.url,
                               result_backend=second_redis.url))
    letters = DeadLetters(app)
    client = second_redis.client()

    started = time.perf_counter()
    fill_dead_letters(letters, varied_letters(N))
    fill_seconds = time.perf_counter() - started

    page, page_seconds, page_commands = measured(client, lambda: letters.page(limit=50))
    assert len(page.letters) == 50 and page.total == N
    assert page.letters[0].dead_lettered_at > page.letters[-1].dead_lettered_at
    deep, deep_seconds, deep_commands = measured(
        client, lambda: letters.page(limit=50, before=page.next_cursor))
    assert len(deep.letters) == 50
    # list() is the first page, through the same cursor walk (no scan either).
    listed, _, list_commands = measured(client, lambda: letters.list(limit=50))
    assert [letter.task_id for letter in listed] == [letter.task_id for letter in page.letters]
    billing = letters.list("billing", limit=20)
    assert [letter.task_id for letter in billing] == [
        letter.task_id for letter in letters.page(DeadLetterQuery(queue="billing"),
                                                  limit=20).letters]
    assert len(billing) == 20 and all(letter.queue == "billing" for letter in billing)
    assert letters.list("no-such-queue") == [] and letters.list(limit=0) == []
    filtered, filtered_seconds, filtered_commands = measured(
        client, lambda: letters.page(DeadLetterQuery(queue="billing", effect="read_only",
                                                     reason="not_retryable"), limit=50))
    assert len(filtered.letters) == 50
    assert all(letter.queue == "billing" and letter.effect == "read_only"
               and letter.reason == "not_retryable" for letter in filtered.letters)
    # The worst case of several filters: no letter matches them all, so the
    # smallest of their indexes is walked to its end.
    empty, empty_seconds, empty_commands = measured(
        client, lambda: letters.page(DeadLetterQuery(failure_class="connection",
                                                     reason="unknown_task"), limit=50))
    assert empty.letters == []
    smallest = min(int(client.zcard(key)) for key in (
        letters.keys.dead_letter_facet("reason", "unknown_task"),
        letters.keys.dead_letter_facet("failure_class", "connection")))
    shown, show_seconds, show_commands = measured(
        client, lambda: letters.get(str(uuid.UUID(int=4242))))
    assert shown is not None and shown.args == ["customer-4242", 4242]
    stats, stats_seconds, stats_commands = measured(client, letters.stats)
    assert stats.total == N
    assert sum(stats.by_queue.values()) == sum(stats.by_effect.values()) == N
    assert stats.by_reason["not_retryable"] == N // 4

    # The number of commands does not depend on N: a page reads its 50 entries
    # (pipelined), stats read one size per index.
    assert page_commands < 80 and deep_commands < 80, (page_commands, deep_commands)
    assert list_commands == page_commands, (list_commands, page_commands)
    assert filtered_commands < 400, filtered_commands
    assert show_commands <= 2 and stats_commands < 40, (show_commands, stats_commands)

    env = dict(os.environ)
    env.update(TE_PREFIX=prefix, TE_BROKER=second_redis.url, PYTHONPATH=str(TESTS.parent),
               COLUMNS="160")
    startup, _ = cli(env, "--help")
    list_time, listed = cli(env, "dlq", "list", "--limit", "50")
    assert "50 shown of 100000" in listed.stdout
    stats_time, counted = cli(env, "dlq", "stats")
    assert any(line.split() == ["total", str(N)] for line in counted.stdout.splitlines())

    print(
        f"\n{N} dead letters written in {fill_seconds:.1f}s\n"
        f"DeadLetters.page(limit=50):                {page_seconds * 1000:7.1f} ms, "
        f"{page_commands} Redis commands\n"
        f"  next page (cursor):                      {deep_seconds * 1000:7.1f} ms, "
        f"{deep_commands} commands\n"
        f"  3 filters (queue, effect, reason):       {filtered_seconds * 1000:7.1f} ms, "
        f"{filtered_commands} commands\n"
        f"  3 filters, no match (worst case, walks {smallest} entries): "
        f"{empty_seconds * 1000:7.1f} ms, {empty_commands} commands\n"
        f"DeadLetters.get (show):                    {show_seconds * 1000:7.1f} ms, "
        f"{show_commands} commands\n"
        f"DeadLetters.stats():                       {stats_seconds * 1000:7.1f} ms, "
        f"{stats_commands} commands\n"
        f"CLI, best of 3 (whole process):\n"
        f"  celery -A ... tooleffect --help          {startup * 1000:7.0f} ms (start-up)\n"
        f"  celery -A ... tooleffect dlq list -n 50  {list_time * 1000:7.0f} ms\n"
        f"  celery -A ... tooleffect dlq stats       {stats_time * 1000:7.0f} ms"
    )
    # Generous bounds: the process start-up dominates.
    assert list_time < startup + 3.0 and stats_time < startup + 3.0
