"""The pytest plugin, run the way a user runs it: a test file of the user's
(``pytester``) enables the plugin, names its app, and crashes a worker at each
boundary of an attempt; each ending is what the table "How a task ends" (docs/guide.md) promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(900)

USER_TESTS = '''
import pytest

pytest_plugins = ["celery_tooleffect.pytest_plugin"]
pytestmark = pytest.mark.tooleffect_app("tests.apps.plugin_app")

#: (tool, boundary) -> (how it ends, how many intents were recorded)
EXPECTED = {
    ("user.lookup", "before_intent"): ("succeeded", 0),
    ("user.lookup", "after_intent"): ("succeeded", 0),
    ("user.lookup", "in_body"): ("succeeded", 0),
    ("user.lookup", "before_outcome"): ("succeeded", 0),
    ("user.lookup", "before_ack"): ("succeeded", 0),
    ("user.save", "before_intent"): ("succeeded", 1),
    ("user.save", "after_intent"): ("succeeded", 2),
    ("user.save", "in_body"): ("succeeded", 2),
    ("user.save", "before_outcome"): ("succeeded", 2),
    ("user.save", "before_ack"): ("succeeded", 1),
    ("user.send", "before_intent"): ("succeeded", 1),
    ("user.send", "after_intent"): ("dead_letter", 1),
    ("user.send", "in_body"): ("dead_letter", 1),
    ("user.send", "before_outcome"): ("dead_letter", 1),
    ("user.send", "before_ack"): ("succeeded", 1),
}


@pytest.mark.parametrize("tool, boundary", list(EXPECTED))
def test_a_crash_at_each_boundary(tooleffect, tool, boundary):
    ending = tooleffect.run(tool, "k", crash_at=boundary)
    print("MATRIX", tool, boundary, ending.settled, ending.intents,
          ending.dead_letter.reason if ending.dead_letter else "-")
    assert ending.crashed, ending.describe()
    assert (ending.settled, ending.intents) == EXPECTED[tool, boundary], ending.describe()
    if ending.settled == "dead_letter":
        assert ending.dead_letter.reason == "interrupted_write"
    else:
        assert ending.result == "k"


#: Only the pool process dies: the worker's main process ends the call.
POOL_KILLS = {
    ("user.lookup", "in_body"): ("succeeded", 0),
    ("user.save", "in_body"): ("succeeded", 2),
    ("user.send", "in_body"): ("dead_letter", 1),
    ("user.send", "before_outcome"): ("dead_letter", 1),
}


@pytest.mark.parametrize("tool, boundary", list(POOL_KILLS))
def test_a_pool_process_killed_at_a_boundary(tooleffect, tool, boundary):
    ending = tooleffect.run(tool, "k", crash_at=boundary, kill="pool")
    assert ending.crashed, ending.describe()
    assert (ending.settled, ending.intents) == POOL_KILLS[tool, boundary], ending.describe()


#: (tool, boundary) -> (how it ends, dead-letter reason, exception type)
STORE_FAULTS = {
    ("user.lookup", "before_outcome"): ("succeeded", "", ""),
    ("user.save", "before_intent"): ("dead_letter", "retries_exhausted", "IntentNotRecorded"),
    ("user.send", "before_outcome"): ("dead_letter", "not_retryable", "AuditPersistenceFailed"),
}


@pytest.mark.parametrize("tool, boundary", list(STORE_FAULTS))
def test_the_store_refusing_writes_at_a_boundary(tooleffect, tool, boundary):
    ending = tooleffect.run(tool, "k", store_fault_at=boundary)
    settled, reason, exception = STORE_FAULTS[tool, boundary]
    assert ending.settled == settled, ending.describe()
    if reason:
        assert ending.dead_letter.reason == reason, ending.describe()
        assert ending.dead_letter.exception_type == exception, ending.describe()
        assert ending.intents == 0 or ending.dead_letter.body_completed


def test_a_failing_assertion_says_what_ran(tooleffect):
    ending = tooleffect.run("user.send", "k", crash_at="in_body")
    assert ending.settled == "succeeded", ending.describe()
'''


def test_each_boundary_gives_the_documented_ending(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the user's app: tests.apps.plugin_app
    pytester.makepyfile(test_user_tools=USER_TESTS)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", "-s", "-q",
        f"--tooleffect-redis-url={REDIS_URL}", "--rootdir", str(pytester.path),
    )
    result.assert_outcomes(passed=22, failed=1)
    # The failing test reports what ran and where the call ended.
    result.stdout.fnmatch_lines([
        "*task *: dead_letter (backend *) dead letter interrupted_write*; "
        "crash at in_body: crashed; journal dead_lettered; audit: intent started*",
    ])


def test_the_plugin_starts_a_redis_of_its_own_when_given_none(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("TOOLEFFECT_TEST_REDIS_URL", raising=False)
    pytester.makepyfile(test_embedded=EMBEDDED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-s",
                                           "--rootdir", str(pytester.path))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["REDIS redis://127.0.0.1:*"])


EMBEDDED = '''
import pytest

pytest_plugins = ["celery_tooleffect.pytest_plugin"]
pytestmark = pytest.mark.tooleffect_app("tests.apps.plugin_app")


def test_a_write_on_the_embedded_redis(tooleffect, tooleffect_redis_url):
    from tests.support import REDIS_URL

    print("REDIS", tooleffect_redis_url)
    assert tooleffect_redis_url != REDIS_URL  # a server the plugin started
    ending = tooleffect.run("user.send", "k", crash_at="before_ack")
    assert ending.crashed and (ending.settled, ending.intents) == ("succeeded", 1)
'''


def test_the_plugin_works_beside_celerys_own_fixtures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, prefix: str,
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("BESIDE_PREFIX", prefix)  # deleted by the prefix fixture
    # Celery's own app (memory:// broker) names its store: never the default one.
    monkeypatch.setenv("BESIDE_REDIS_URL", REDIS_URL)
    pytester.makepyfile(test_beside=BESIDE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q",
                                           f"--tooleffect-redis-url={REDIS_URL}",
                                           "--rootdir", str(pytester.path))
    result.assert_outcomes(passed=2)


BESIDE = '''
import os

import pytest

from celery_tooleffect import ToolTask

pytest_plugins = ["celery_tooleffect.pytest_plugin", "celery.contrib.pytest"]


@pytest.fixture(scope="session")
def celery_config():
    return {"broker_url": "memory://", "result_backend": "cache+memory://",
            "tooleffect_redis_url": os.environ["BESIDE_REDIS_URL"],
            "tooleffect_key_prefix": os.environ["BESIDE_PREFIX"] + "te:"}


@pytest.fixture(scope="session")
def celery_worker_parameters():
    return {"perform_ping_check": False}


def test_celerys_own_fixtures_run_a_tool_in_process(celery_app, celery_worker):
    @celery_app.task(base=ToolTask, name="beside.lookup", shared=False)
    def lookup(key):
        return key

    celery_worker.reload()
    assert lookup.delay("k").get(timeout=10) == "k"


@pytest.mark.tooleffect_app("tests.apps.plugin_app")
def test_the_plugin_beside_them(tooleffect):
    ending = tooleffect.run("user.save", "k", crash_at="before_ack")
    assert ending.crashed and ending.settled == "succeeded"
'''
