"""Celery's own integration suite, once on plain Celery and once with ToolTask
as every task's base, side by side; fails when ToolTask breaks a test that
plain Celery passes.

    python compat/celery_suite/run.py [--keep DIR] [pytest args...]

What it does, in the Python environment it runs in (``nox -s celery_suite``
makes one):

1. downloads the sdist of the installed Celery from the package index
   (``pip download --no-binary :all:``) and unpacks its ``t/`` into a work
   directory, with this folder's ``conftest.py`` and ``pytest.ini`` beside
   it (so the installed Celery is tested, not the sdist's copy);
2. starts two ``redis-server``s of its own on free ports (AOF, fsync every
   second: the package's workers refuse a store that loses what it
   acknowledged on a restart, docs/redis.md#durability),
   one per run, and runs ``t/integration/test_canvas.py`` and
   ``t/integration/test_tasks.py`` in both at once: ``plain`` and ``tool``
   (``SUITE_TASK_CLS=celery_tooleffect:ToolTask``; the package's store is
   that run's Redis), each writing a JUnit report;
3. compares them: every test that passed on plain Celery must pass with
   ToolTask, except those listed in ``differences.txt`` (a test id, then the
   documented rule that makes it differ). It prints both runs' counts and
   each difference, and exits 1 on a new one (0 otherwise).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE = ["t/integration/test_canvas.py", "t/integration/test_tasks.py"]
RUNS = {"plain": None, "tool": "celery_tooleffect:ToolTask"}
#: A run that has not ended by then is stopped (and fails the comparison).
RUN_TIMEOUT = 40 * 60


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path,
                        help="work directory to keep (default: a temporary one)")
    options, pytest_args = parser.parse_known_args()
    work = options.keep or Path(tempfile.mkdtemp(prefix="celery-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    suite = unpack_suite(work)
    servers = {name: RedisProcess(work / f"redis-{name}") for name in RUNS}
    try:
        started = time.monotonic()
        runs = {name: start_run(name, task_cls, suite, servers[name], work, pytest_args)
                for name, task_cls in RUNS.items()}
        codes = {}
        for name, process in runs.items():
            left = max(RUN_TIMEOUT - (time.monotonic() - started), 1)
            try:
                codes[name] = process.wait(timeout=left)
            except subprocess.TimeoutExpired:
                process.kill()
                codes[name] = process.wait()
                print(f"{name}: stopped after {RUN_TIMEOUT} s", file=sys.stderr)
        took = time.monotonic() - started
        results = {name: outcomes(work / f"{name}.xml") for name in RUNS}
        for name in RUNS:
            print(f"--- {name} run (pytest exit {codes[name]}): log {work / f'{name}.log'}")
            print(f"{name}: {summary(results[name])}")
        print(f"both runs side by side: {took:.0f} s")
        listed = reasoned_differences()
        new = [test for test in differing(results["plain"], results["tool"])
               if test not in listed]
        if new:
            # The suite's timings make some of its tests flaky on plain Celery
            # too (it marks them @flaky): a new difference is run once more,
            # alone, and counts only if it fails again.
            print(f"running the {len(new)} new difference(s) again, with ToolTask")
            again = start_run("tool-again", RUNS["tool"], suite, servers["tool"], work,
                              [*pytest_args, *(pytest_id(test) for test in new)], paths=[])
            again.wait(timeout=RUN_TIMEOUT)
            for test, outcome in outcomes(work / "tool-again.xml").items():
                if outcome == "passed" and test in new:
                    print(f"passed when run again (flaky): {test}")
                    results["tool"][test] = "passed"
    finally:
        for server in servers.values():
            server.stop()
    return compare(results["plain"], results["tool"], listed)


def unpack_suite(work: Path) -> Path:
    """``t/`` of the installed Celery's sdist, in ``work/suite`` (downloaded once)."""
    import celery

    version = celery.__version__
    suite = work / "suite"
    if (suite / "t" / "integration").is_dir():
        return suite
    downloads = work / "sdist"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         f"celery=={version}", "--dest", str(downloads)],
        check=True,
    )
    (archive,) = downloads.glob(f"celery-{version}.tar.gz")
    suite.mkdir()
    with tarfile.open(archive) as sdist:
        prefix = f"celery-{version}/t/"
        members = [m for m in sdist.getmembers() if m.name.startswith(prefix)]
        for member in members:
            member.name = member.name[len(f"celery-{version}/"):]
        sdist.extractall(suite, members=members, filter="data")
    for name in ("conftest.py", "pytest.ini"):
        shutil.copy(HERE / name, suite / name)
    print(f"Celery {version}'s suite from its sdist: {suite}")
    return suite


class RedisProcess:
    """A ``redis-server`` of this run's own on a free port, with AOF (everysec)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_run(name: str, task_cls: str | None, suite: Path, server: RedisProcess, work: Path,
              pytest_args: list[str], paths: list[str] = SUITE) -> subprocess.Popen[bytes]:
    """One pytest run of the suite, on ``server`` (broker, result backend and,
    with ToolTask, the package's store)."""
    env = dict(os.environ, TEST_BROKER=server.url, TEST_BACKEND=server.url,
               REDIS_HOST="127.0.0.1", REDIS_PORT=str(server.port))
    env.pop("SUITE_TASK_CLS", None)
    if task_cls:
        env["SUITE_TASK_CLS"] = task_cls
    log = (work / f"{name}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
         f"--junitxml={work / f'{name}.xml'}", *paths, *pytest_args],
        cwd=suite, env=env, stdout=log, stderr=subprocess.STDOUT,
    )


def outcomes(report: Path) -> dict[str, str]:
    """Each test's outcome in a JUnit report: passed, failed, error or skipped."""
    if not report.exists():
        return {}
    found = {}
    for case in ElementTree.parse(report).iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "error" in kinds:
            found[test_id] = "error"
        elif "failure" in kinds:
            found[test_id] = "failed"
        elif "skipped" in kinds:
            found[test_id] = "skipped"
        else:
            found[test_id] = "passed"
    return found


def summary(results: dict[str, str]) -> str:
    counts = Counter(results.values())
    return ", ".join(f"{counts[kind]} {kind}" for kind in ("passed", "failed", "error", "skipped"))


def reasoned_differences() -> dict[str, str]:
    """``differences.txt``: test id, whitespace, the rule that makes it differ."""
    listed = {}
    for line in (HERE / "differences.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            test_id, _, why = line.partition(" ")
            listed[test_id] = why.strip()
    return listed


def differing(plain: dict[str, str], tool: dict[str, str]) -> list[str]:
    """The tests that passed on plain Celery and not with ToolTask."""
    return sorted(test for test, outcome in plain.items()
                  if outcome == "passed" and tool.get(test) != "passed")


def pytest_id(test: str) -> str:
    """A JUnit ``classname::name`` (``t.integration.test_canvas.test_chord::test_x``)
    as a pytest node id (``t/integration/test_canvas.py::test_chord::test_x``)."""
    classname, _, name = test.partition("::")
    parts = classname.split(".")  # t, integration, test_<module>, [class]
    return "::".join([f"{'/'.join(parts[:3])}.py", *parts[3:], name])


def compare(plain: dict[str, str], tool: dict[str, str], listed: dict[str, str]) -> int:
    if not plain or not tool:
        print("a run left no report: nothing to compare", file=sys.stderr)
        return 1
    broken = differing(plain, tool)
    new = [test for test in broken if test not in listed]
    for test in broken:
        why = listed.get(test)
        mark = f"reasoned: {why}" if why else "NEW"
        print(f"differs ({tool.get(test, 'missing')} with ToolTask): {test}  [{mark}]")
    for test in sorted(set(listed) - set(broken)):
        print(f"listed in differences.txt but no longer differs: {test}")
    print(f"{len(broken)} test(s) pass on plain Celery and not with ToolTask; "
          f"{len(broken) - len(new)} reasoned, {len(new)} new")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
