"""The compatibility matrix: the core scenarios against the lowest and the newest
celery, kombu and redis-py that ``pyproject.toml`` admits, with and without hiredis.

    nox -s compat                        # all four
    nox -s "compat(lowest-pure)"         # one: lowest|newest - hiredis|pure

Each session installs the package with its test dependencies into its own venv,
pins the versions, removes hiredis for the ``pure`` sessions, prints what it
runs against, and runs the core scenarios on the Redis the tests use
(``TOOLEFFECT_TEST_REDIS_URL``, default 127.0.0.1:6379). ``.ci/run`` runs
``compat(lowest-pure)`` with kombu's own fetch (``TOOLEFFECT_TEST_FETCH=kombu``,
which the test apps turn into ``tooleffect_atomic_fetch=False``) while its main
run uses the atomic fetch, so the core scenarios run on both; all four are run
by hand before a release.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

#: The floor of every range in pyproject.toml: change both together. Celery and
#: kombu start at 5.7: on celery 5.5.0/kombu 5.5.2 the core scenarios fail (a
#: message rejected for good leaves the task STARTED instead of FAILURE, since
#: celery#4222 is fixed only in 5.7; retries of writes were not acknowledged
#: in time), and the package relies on 5.7's Request behaviour.
LOWEST = ["celery[redis]==5.7.0", "kombu==5.7.0", "redis==6.4.0"]
#: The newest releases the ranges admit (pip picks them with --upgrade).
NEWEST = ["celery[redis]>=5.7,<6", "kombu>=5.7,<6", "redis>=6.4"]

#: What every Celery option, fault and path of the guarantees runs through.
CORE = [
    "tests/test_outcomes.py",
    "tests/test_effects.py",
    "tests/test_failures.py",
    "tests/test_interruptions.py",
    "tests/test_leases.py",
    "tests/test_bad_messages.py",
    "tests/test_celery_paths.py",
    "tests/test_replay.py",
    "tests/test_cli.py",
]


@nox.session
@nox.parametrize(
    ("versions", "parser"),
    [(versions, parser) for versions in ("lowest", "newest") for parser in ("hiredis", "pure")],
    ids=["lowest-hiredis", "lowest-pure", "newest-hiredis", "newest-pure"],
)
def compat(session: nox.Session, versions: str, parser: str) -> None:
    """The core scenarios against one end of the supported range."""
    pins = LOWEST if versions == "lowest" else NEWEST
    session.install("-e", ".[dev]")
    session.install("--upgrade", *pins)
    if parser == "pure":
        session.run("python", "-m", "pip", "uninstall", "--yes", "hiredis")
    session.run(
        "python", "-c",
        "import celery, kombu, redis, sys; "
        "from redis.utils import HIREDIS_AVAILABLE; "
        "print(f'python {sys.version.split()[0]} celery {celery.__version__} "
        "kombu {kombu.__version__} redis-py {redis.__version__} "
        "hiredis {HIREDIS_AVAILABLE}')",
    )
    session.run("python", "-m", "pytest", "-q", *CORE, *session.posargs)


@nox.session(name="celery_suite")
def celery_suite(session: nox.Session) -> None:
    """Celery's own integration suite (``t/integration/test_canvas.py`` and
    ``test_tasks.py`` of the installed Celery's sdist), on plain Celery and with
    ``task_cls=ToolTask``, on Redis servers of its own: fails when a test that
    passes on plain Celery fails with ToolTask and is not a reasoned
    difference (``compat/celery_suite/``). Posargs go to both pytest runs."""
    session.install("-e", ".[dev]")
    # What the suite imports besides Celery: its flaky marker reruns
    # (pytest-rerunfailures) and t/integration/tasks.py's pydantic models.
    session.install("pytest-rerunfailures", "pydantic")
    session.run("python", "compat/celery_suite/run.py", *session.posargs)
