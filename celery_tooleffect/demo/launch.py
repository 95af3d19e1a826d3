"""What the demo starts and how other processes reach it: its app, its
``redis-server``\\ s, its ``celery worker`` subprocesses, and the commands it
prints.

The demo's app is built by :func:`build_app`, explicitly, from a broker, a
store and a key prefix. A process the demo does not run itself (act 6's
workers, act 4's CLI command, the commands ``--keep`` prints) loads it with
``celery -A celery_tooleffect.demo.worker_app``: that module builds it at
import from the variables :data:`ENV_WORKER` (:func:`worker_env` writes them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from celery import Celery

from ..testing import (
    RedisServer,
    WorkerProcess,
    configure_for_test,
    redis_server_binary,
    start_celery_worker,
)

#: Names an existing Redis as the demo's broker (``--redis-url`` wins).
ENV_REDIS_URL = "TOOLEFFECT_DEMO_REDIS_URL"

#: The broker, the audit store and the key prefix of the demo's app, for
#: ``celery_tooleffect.demo.worker_app``.
ENV_WORKER = ("TOOLEFFECT_DEMO_BROKER", "TOOLEFFECT_DEMO_STORE", "TOOLEFFECT_DEMO_PREFIX")

#: ``celery -A`` of the demo's app, as the CLI, Flower and act 6's workers load it.
APP_SPEC = "celery_tooleffect.demo.worker_app"

#: The queue the demo's tools are sent to.
QUEUE = "agent-tools"

#: Act 6's workers: a killed worker's message is delivered again after this
#: many seconds (kombu's Redis ``visibility_timeout``), or when the write's
#: lease ends (its ``operation_deadline``), whichever is later.
WORKER_VISIBILITY_TIMEOUT = 3.0

#: Where ``--keep``'s Flower command listens (Flower's default port, loopback only).
FLOWER_ADDRESS = "127.0.0.1"
FLOWER_PORT = 5555


def build_app(broker_url: str, store_url: str, prefix: str,
              visibility_timeout: float = 3600.0) -> Celery:
    """A Celery app (no tools yet) whose every key lives under ``prefix``:
    broker and results on ``broker_url``, the store on ``store_url``
    (:func:`configure_for_test`, the pytest plugin's settings), its tasks sent
    to :data:`QUEUE`."""
    app = Celery("tooleffect-demo", set_as_current=False)
    app.conf.update(
        task_default_queue=QUEUE,
        worker_hijack_root_logger=False,
        tooleffect_socket_timeout=2.0,
    )
    return configure_for_test(app, broker_url, prefix, visibility_timeout, store_url)


def worker_env(broker_url: str, store_url: str, prefix: str) -> dict[str, str]:
    """The variables ``celery_tooleffect.demo.worker_app`` is built from."""
    return dict(zip(ENV_WORKER, (broker_url, store_url, prefix), strict=True))


def app_from_environment() -> Celery:
    """:func:`build_app` with the broker, store and prefix named by
    :data:`ENV_WORKER`; ``RuntimeError`` (saying which) when one is unset."""
    missing = [name for name in ENV_WORKER if not os.environ.get(name)]
    if missing:
        # Said plainly: a newcomer who pastes one of --keep's commands without
        # its export lines gets this, not a KeyError.
        raise RuntimeError(
            f"{APP_SPEC} is the demo's app, built from the environment: set "
            f"{', '.join(missing)} (python -m celery_tooleffect.demo --keep prints them)"
        )
    broker_url, store_url, prefix = (os.environ[name] for name in ENV_WORKER)
    return build_app(broker_url, store_url, prefix, visibility_timeout=WORKER_VISIBILITY_TIMEOUT)


@contextlib.contextmanager
def worker_processes(env: dict[str, str]) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``celery worker`` subprocesses of the demo's app (prefork, one pool
    process), built from ``env`` (:func:`worker_env`); every one started is
    killed at the end.

    ``start(crash_at="before_outcome@agent.charge_card")`` arms the worker with
    the package's crash points (``TOOLEFFECT_CRASH_AT``, as the pytest plugin
    does): the first attempt of that tool to reach that boundary SIGKILLs the
    whole worker, once."""
    started: list[WorkerProcess] = []
    with tempfile.TemporaryDirectory(prefix="tooleffect-demo-") as folder:
        def start(crash_at: str | None = None) -> WorkerProcess:
            armed = {} if crash_at is None else {
                "TOOLEFFECT_CRASH_AT": crash_at,
                "TOOLEFFECT_CRASH_MARK": str(Path(folder) / "crashed"),
            }
            worker = start_celery_worker(
                APP_SPEC, Path(folder) / f"worker-{len(started)}.log",
                name=f"demo{len(started) + 1}", queues=QUEUE, env={**env, **armed},
            )
            started.append(worker)
            return worker

        try:
            yield start
        finally:
            for worker in started:
                worker.kill()


def start_redis(workdir: Path, *, detached: bool) -> RedisServer:
    """A started ``redis-server`` of the demo's own: a free loopback port, an
    append-only file, its files in ``workdir`` (created).

    ``detached``: in a session of its own, so that nothing that ends the demo
    (its terminal's Ctrl-C, a supervisor that kills its process group) ends
    the server ``--keep`` leaves running.
    """
    workdir.mkdir(parents=True)
    return RedisServer(appendonly=True, workdir=str(workdir)).start(detached=detached)


@contextlib.contextmanager
def servers(named: str, prefix: str, *, keep: bool) -> Iterator[tuple[str, str]]:
    """The demo's broker and audit store, their URLs printed as they start:
    the broker is the Redis ``named`` (when given) or a ``redis-server`` of
    the demo's own, the store always one of its own (:func:`start_redis`, in a
    temporary folder).

    At the end the servers are stopped and their folder deleted; with ``keep``
    (once both started, whatever happens next: what went wrong is what one
    would want to look at) they keep running, and how to stop them is printed
    (:func:`stop_instructions`)."""
    folder = Path(tempfile.mkdtemp(prefix="tooleffect-demo-"))
    started: list[RedisServer] = []
    broker_url, kept = named, False
    try:
        if named:
            print(f"Broker: the Redis you named, at {broker_url}")
        else:
            started.append(start_redis(folder / "broker", detached=keep))
            broker_url = started[-1].url
            print(f"Broker: a redis-server of the demo's own at {broker_url} "
                  f"({redis_server_binary()})")
        started.append(start_redis(folder / "store", detached=keep))
        print(f"Audit store (tooleffect_redis_url): a redis-server of the demo's own at "
              f"{started[-1].url}")
        kept = keep
        yield broker_url, started[-1].url
    finally:
        if kept:
            print()
            print(stop_instructions(started, folder, broker_url, prefix if named else None))
        else:
            for server in started:
                server.kill()
            shutil.rmtree(folder, ignore_errors=True)


def celery_command() -> list[str]:
    """How a shell runs this interpreter's ``celery``: plain ``celery`` when
    that is the one on PATH, else its path (an unactivated virtualenv), else
    ``python -m celery``."""
    beside = Path(sys.executable).parent / "celery"
    if not beside.exists():
        return [sys.executable, "-m", "celery"]
    found = shutil.which("celery")
    if found and Path(found).resolve() == beside.resolve():
        return ["celery"]
    return [str(beside)]


def tooleffect_command(*arguments: str) -> list[str]:
    """``celery -A celery_tooleffect.demo.worker_app tooleffect <arguments>``."""
    return [*celery_command(), "-A", APP_SPEC, "tooleffect", *arguments]


def keep_instructions(env: dict[str, str], approved_id: str, dead_letter_id: str) -> str:
    """What ``--keep`` prints: the shell lines that open the kept dead letter,
    approval and audit trails in the CLI and Flower (each runs as printed)."""
    lines = [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    for arguments in (
        ("dlq", "list"),
        ("dlq", "show", dead_letter_id),
        ("audit", "show", dead_letter_id),
        ("approvals", "show", approved_id),
        ("audit", "show", approved_id),
        ("flower", f"--address={FLOWER_ADDRESS}", f"--port={FLOWER_PORT}"),
    ):
        lines.append(shlex.join(tooleffect_command(*arguments)))
    flower = f"http://{FLOWER_ADDRESS}:{FLOWER_PORT}"
    missing = ([] if importlib.util.find_spec("flower") else
               ["Flower is not installed here: pip install 'celery-tooleffect[flower]'."])
    return "\n".join([
        "Kept (--keep): the demo's keys, its dead letter, approval and audit trails. Open "
        "them from a shell:",
        "",
        *(f"    {line}" for line in lines),
        "",
        "The last command starts Flower (Ctrl-C stops it); then open:",
        f"    {flower}/dead-letters/{dead_letter_id}  (run 5's dead letter)",
        f"    {flower}/approvals/{approved_id}  (run 4's approval, with its audit trail)",
        *missing,
    ])


def stop_instructions(started: Sequence[RedisServer], folder: Path, broker_url: str,
                      prefix: str | None) -> str:
    """What ``--keep`` prints last: how to stop the servers it leaves running
    (and delete their files), and the keys it left on a Redis it was given."""
    lines = []
    if started:
        # SIGTERM: the server creates no file as it shuts down (no RDB snapshot
        # is configured), so its folder can go at once.
        pids = " ".join(str(server.process.pid) for server in started if server.process)
        lines += [f"The redis-server(s) the demo started keep running, detached ({len(started)}). "
                  "To stop them and delete their files:",
                  f"    kill {pids} && rm -rf {shlex.quote(str(folder))}"]
    if prefix is not None:
        code = ("from celery_tooleffect.testing import delete_keys; "
                f"print(delete_keys({json.dumps(broker_url)}, {json.dumps(prefix)}))")
        lines += ["The demo's keys stay on the Redis you named. To delete them:",
                  f"    {shlex.quote(sys.executable)} -c {shlex.quote(code)}"]
    return "\n".join(lines)
