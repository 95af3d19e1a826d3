"""docker-compose.yml names only things that exist (checked without Docker).

There is no Docker engine where the tests run, so this reads the compose file
and checks what it points at: Redis persists (``--appendonly yes``), every
bind-mounted path and every file a command copies exists, the ``-A`` app
module is a real file that the ``celery`` command line loads (with the broker
from ``REDIS_URL``), the ``worker`` and ``tooleffect flower`` subcommands
exist, and the extras ``pip install`` asks for are declared in pyproject.toml.
Then it runs what the stack runs, on a redis-server of its own: the example
worker and the producer's module, and checks that the runs end in the dead
letters the Dead letters page is meant to show.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import RedisServer

try:
    import tomllib
except ImportError:  # Python 3.10: pytest brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
RABBITMQ_COMPOSE = ROOT / "docker-compose.rabbitmq.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    found = compose.get("services")
    assert isinstance(found, dict)
    return found


def argv(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]


def shell_steps(command: str | list[str]) -> list[list[str]]:
    """The simple commands of a service's command (``sh -c "a && b"`` gives a and b)."""
    words = argv(command)
    if words[:2] == ["sh", "-c"] or words[:2] == ["bash", "-c"]:
        script = words[2]
        return [shlex.split(step) for step in re.split(r"&&|;|\n", script) if step.strip()]
    return [words]


def celery_step(command: str | list[str]) -> list[str]:
    for step in shell_steps(command):
        words = step[1:] if step and step[0] == "exec" else step
        if words and words[0] == "celery":
            return words
    raise AssertionError(f"no celery command in {command!r}")


def app_module(words: list[str]) -> str:
    for flag in ("-A", "--app"):
        if flag in words:
            return words[words.index(flag) + 1]
    for word in words:
        if word.startswith("--app="):
            return word.split("=", 1)[1]
    raise AssertionError(f"no -A in {words!r}")


def bind_sources(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host path, container path) of each bind mount of ``service``."""
    mounts: list[tuple[str, str]] = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type", "volume") == "bind":
                mounts.append((str(volume["source"]), str(volume["target"])))
            continue
        source, target = str(volume).split(":")[:2]
        if source.startswith((".", "/", "~")):
            mounts.append((source, target))
    return mounts


def test_services_are_redis_worker_flower_and_producer(services: dict[str, Any]) -> None:
    assert {"redis", "worker", "flower", "producer"} <= set(services)


def test_redis_is_7_and_keeps_an_append_only_file(services: dict[str, Any]) -> None:
    redis = services["redis"]
    assert str(redis["image"]).split(":")[:2] == ["redis", "7"]
    words = argv(redis["command"])
    assert words[0] == "redis-server"
    assert "--appendonly" in words
    assert words[words.index("--appendonly") + 1] == "yes"


def test_every_volume_source_exists(compose: dict[str, Any], services: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for volume in service.get("volumes", []):
            if isinstance(volume, dict):
                source = str(volume.get("source", ""))
                is_bind = volume.get("type", "volume") == "bind"
            else:
                source = str(volume).split(":")[0]
                is_bind = source.startswith((".", "/", "~"))
            if is_bind:
                path = (COMPOSE.parent / os.path.expanduser(source)).resolve()
                assert path.exists(), f"{name}: volume source {source} does not exist"
            else:
                assert source in declared, f"{name}: named volume {source} is not declared"


@pytest.mark.parametrize("name", ["worker", "flower", "producer"])
def test_python_services_mount_the_source_as_their_working_dir(
    services: dict[str, Any], name: str
) -> None:
    service = services[name]
    assert service["image"] == "python:3.11-slim"
    mounts = dict((target, source) for source, target in bind_sources(service))
    workdir = service["working_dir"]
    assert workdir in mounts, f"{name}: working_dir {workdir} is not a mounted folder"
    assert (COMPOSE.parent / mounts[workdir]).resolve() == ROOT
    assert "redis" in str(service.get("depends_on"))


@pytest.mark.parametrize("name", ["worker", "flower", "producer"])
def test_install_steps_name_real_files_and_extras(services: dict[str, Any], name: str) -> None:
    """What the command copies exists; ``pip install`` installs that copy, with real extras."""
    steps = shell_steps(services[name]["command"])
    copied_to = None
    for step in steps:
        if step[0] == "cp":
            *sources, copied_to = [word for word in step[1:] if not word.startswith("-")]
            for source in sources:
                assert (ROOT / source).exists(), f"{name}: {source} is copied but missing"
    installs = [step for step in steps if step[:2] == ["pip", "install"]]
    assert installs, f"{name}: the package is not installed"
    extras_declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                          ["project"]["optional-dependencies"])
    for step in installs:
        target = next(word for word in step[2:] if not word.startswith("-"))
        match = re.fullmatch(r"([^\[]+)(?:\[([^\]]*)\])?", target)
        assert match is not None
        path, extras = match.group(1), match.group(2)
        assert path.rstrip("/") in {str(copied_to).rstrip("/"), services[name]["working_dir"]}
        for extra in filter(None, (extras or "").split(",")):
            assert extra.strip() in extras_declared, f"{name}: no extra {extra!r}"


@pytest.mark.parametrize(
    ("name", "subcommand"), [("worker", "worker"), ("flower", "tooleffect flower")]
)
def test_celery_commands_load_a_real_app_module(
    services: dict[str, Any], name: str, subcommand: str
) -> None:
    service = services[name]
    words = celery_step(service["command"])
    after_app = words[words.index(app_module(words)) + 1:]
    assert after_app[: len(subcommand.split())] == subcommand.split(), words
    module = app_module(words)
    module_file = ROOT / (module.split(":")[0].replace(".", "/") + ".py")
    assert module_file.is_file(), f"{name}: -A {module}: {module_file} does not exist"

    # The celery command line loads the module from the working directory,
    # as the container does, with the broker URL the compose file gives it.
    env = dict(os.environ)
    env.update({key: str(value) for key, value in service.get("environment", {}).items()})
    report = subprocess.run(
        [sys.executable, "-m", "celery", "-A", module, "report"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert report.returncode == 0, report.stderr
    host = env["REDIS_URL"].split("//", 1)[1].split(":")[0].split("/")[0]
    assert host in services, f"REDIS_URL names {host}, which is not a service"
    assert f"results:{env['REDIS_URL']}" in report.stdout

    # ...and the subcommand exists (flower and tooleffect register themselves
    # as celery commands).
    usage = subprocess.run(
        [sys.executable, "-m", "celery", "-A", module, *subcommand.split(), "--help"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert usage.returncode == 0, usage.stderr
    assert f"celery {subcommand}" in usage.stdout


def test_the_example_app_registers_the_demo_tools() -> None:
    code = (
        "import examples.agent_app as m; from celery_tooleffect import ToolTask; "
        "print(sorted(n for n, t in m.app.tasks.items() if isinstance(t, ToolTask)))"
    )
    listed = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=False, env=dict(os.environ, REDIS_URL="redis://redis:6379/0"),
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split("\n")[0] == str(
        ["agent.charge_card", "agent.refund_order", "agent.search_catalog",
         "agent.send_invoice", "agent.set_shipping_address", "agent.sync_crm_contact"]
    )


def test_flower_publishes_port_5555(services: dict[str, Any]) -> None:
    flower = services["flower"]
    assert "--port=5555" in celery_step(flower["command"]) or "5555" in celery_step(
        flower["command"]
    )
    assert any(str(port).split(":")[-1] == "5555" for port in flower.get("ports", []))


def test_the_producer_runs_a_real_module(services: dict[str, Any]) -> None:
    steps = shell_steps(services["producer"]["command"])
    run = [step[1:] if step[0] == "exec" else step for step in steps][-1]
    assert run[:2] == ["python", "-m"], run
    module_file = ROOT / (run[2].replace(".", "/") + ".py")
    assert module_file.is_file(), f"producer: {run[2]} does not exist"
    assert services["producer"].get("restart") == "no"
    assert "worker" in services["producer"]["depends_on"]


# -- the RabbitMQ variant (docker-compose.rabbitmq.yml, layered on the file above) ----


@pytest.fixture(scope="module")
def rabbitmq_services() -> dict[str, Any]:
    data = yaml.safe_load(RABBITMQ_COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data["services"]  # type: ignore[no-any-return]


def test_the_rabbitmq_variant_adds_rabbitmq_with_its_management_ui(
    rabbitmq_services: dict[str, Any], services: dict[str, Any],
) -> None:
    rabbitmq = rabbitmq_services["rabbitmq"]
    assert str(rabbitmq["image"]).startswith("rabbitmq:") and "management" in rabbitmq["image"]
    assert any(str(port).split(":")[-1] == "15672" for port in rabbitmq["ports"])
    assert "rabbitmq-diagnostics" in rabbitmq["healthcheck"]["test"]
    # Every Python service of the base file is moved to RabbitMQ, and waits for it.
    layered = {name for name in rabbitmq_services if name != "rabbitmq"}
    assert layered == {"worker", "flower", "producer"} and layered <= set(services)
    for name in layered:
        service = rabbitmq_services[name]
        broker = str(service["environment"]["BROKER_URL"])
        assert broker.startswith("amqp://")
        assert broker.split("@", 1)[1].split(":")[0] == "rabbitmq"
        assert service["depends_on"]["rabbitmq"]["condition"] == "service_healthy"


def test_the_rabbitmq_variant_loads_the_app_with_rabbitmq_as_broker(
    rabbitmq_services: dict[str, Any], services: dict[str, Any],
) -> None:
    env = dict(os.environ)
    for layer in (services["worker"], rabbitmq_services["worker"]):
        env.update({key: str(value) for key, value in layer.get("environment", {}).items()})
    report = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "examples.agent_app", "report"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert report.returncode == 0, report.stderr
    assert "amqp://guest:********@rabbitmq:5672//" in report.stdout
    assert f"results:{env['REDIS_URL']}" in report.stdout


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_the_stack_ends_with_dead_letters_for_the_page(
    aof_redis: RedisServer, tmp_path: Path, broker: str, request: pytest.FixtureRequest,
) -> None:
    """The worker and the producer of the stack, on a Redis of the test's own
    (and, for the RabbitMQ variant, a RabbitMQ virtual host of its own)."""
    env = dict(os.environ, REDIS_URL=aof_redis.url, PYTHONPATH=str(ROOT), COLUMNS="200")
    if broker == "rabbitmq":
        env["BROKER_URL"] = request.getfixturevalue("rabbitmq_url")
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "examples.agent_app", "worker", "--pool",
         "threads", "--concurrency", "2", "--loglevel", "INFO", "--without-gossip",
         "--without-mingle"],
        cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        produced = subprocess.run(
            [sys.executable, "-m", "examples.produce", "--timeout", "60"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
        )
        assert produced.returncode == 0, produced.stdout + produced.stderr + log.read_text()
        assert produced.stdout.count(": dead letter (") == 2, produced.stdout
        listed = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "examples.agent_app", "tooleffect", "dlq",
             "list", "--json"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
        )
        assert listed.returncode == 0, listed.stderr
        letters = {entry["name"]: entry for entry in json.loads(listed.stdout)["dead_letters"]}
        assert set(letters) == {"agent.sync_crm_contact", "agent.charge_card"}
        assert letters["agent.sync_crm_contact"]["failure_class"] == "auth"
        assert letters["agent.sync_crm_contact"]["effect"] == "idempotent_write"
        assert letters["agent.charge_card"]["failure_class"] == "client_error"
        assert letters["agent.charge_card"]["effect"] == "non_idempotent_write"
        assert produced.stdout.count(": awaiting approval (") == 1, produced.stdout
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
