"""``python -m bench.peak_memory -m MODULE ARGS...``: run MODULE as ``python -m``
would, in this process, and print its peak resident memory at exit.

The peak is the process's own high-water mark (``VmHWM`` in
``/proc/self/status``), read as the interpreter exits. ``wait4``'s
``ru_maxrss`` is not used: for a child started by ``vfork``, as Python's
``subprocess`` does, Linux counts the parent's memory at ``exec`` too.
"""

from __future__ import annotations

import atexit
import runpy
import sys

MARK = "bench-peak-rss-kib:"


def report() -> None:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                print(MARK, line.split()[1], file=sys.stderr, flush=True)


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] != "-m":
        raise SystemExit(__doc__)
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    atexit.register(report)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
