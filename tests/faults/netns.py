"""A network namespace of the test's own, joined to the host by a veth pair.

Made with iproute2 (``ip netns``, ``ip link``); needs root (CI runs as root).
The host end of the pair and the namespace's end get the two addresses of a
/30 from 10.200.0.0/13 picked at random, so that tests never use an address
they did not make. ``cut()`` takes the host end down (packets are dropped,
connections stall, nothing is reset), ``heal()`` brings it back.

Namespaces and interfaces are machine-wide, and the suite runs in parallel
(pytest-xdist): every name holds the xdist worker's number (``m`` outside
xdist) and the pid, and each worker draws its /30 from a slice of the /13 of
its own, so that two tests running at once never share a name or a subnet.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import uuid
from types import TracebackType


def namespaces_possible() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"te-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          check=False)
    if made.returncode != 0:
        return f"ip netns add refused: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], check=False)
    return None


#: The /30s of 10.200.0.0/13 (2**17 of them) are split into this many slices,
#: one per xdist worker (gw0 the first, a run without xdist the last).
SLICES = 64


def _worker() -> tuple[str, int]:
    """This process's xdist worker: a short tag for names, and its slice of
    the /13 (``PYTEST_XDIST_WORKER`` is ``gw<N>``; unset without xdist)."""
    found = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    if found is None:
        return "m", SLICES - 1
    number = int(found.group(1))
    return str(number), number % (SLICES - 1)


class Namespace:
    """``ip netns`` namespace with a veth link to the host."""

    def __init__(self) -> None:
        worker, piece = _worker()
        # Interface names have at most 15 characters (IFNAMSIZ - 1): "teh", the
        # worker (3 at most), "p", the pid (5 at most) and 3 random hex digits.
        tag = f"{worker}p{os.getpid() % 100_000}{uuid.uuid4().hex[:3]}"
        self.name = f"te-{tag}"
        self.host_if = f"teh{tag}"
        self.ns_if = f"ten{tag}"
        assert len(self.host_if) <= 15, self.host_if
        # A /30 inside this worker's slice of 10.200.0.0/13.
        per_slice = (1 << 17) // SLICES
        base = (piece * per_slice + random.Random().randrange(0, per_slice)) * 4
        prefix = f"10.{200 + (base >> 16)}.{(base >> 8) & 255}."
        self.host_ip = f"{prefix}{(base & 255) + 1}"
        self.ns_ip = f"{prefix}{(base & 255) + 2}"

    def create(self) -> Namespace:
        run = _run
        run("ip", "netns", "add", self.name)
        run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        run("ip", "link", "set", self.ns_if, "netns", self.name)
        run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        run("ip", "link", "set", self.host_if, "up")
        run(*self.inside("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if))
        run(*self.inside("ip", "link", "set", self.ns_if, "up"))
        run(*self.inside("ip", "link", "set", "lo", "up"))
        return self

    def inside(self, *argv: str) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def cut(self) -> None:
        """The partition: the host end of the link goes down."""
        _run("ip", "link", "set", self.host_if, "down")

    def heal(self) -> None:
        _run("ip", "link", "set", self.host_if, "up")

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], check=False, capture_output=True)
        subprocess.run(["ip", "link", "delete", self.host_if], check=False, capture_output=True)

    def __enter__(self) -> Namespace:
        # __exit__ does not run when __enter__ raises: a namespace or a link
        # made before the step that failed would be left behind.
        try:
            return self.create()
        except BaseException:
            self.delete()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.delete()


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=30)
