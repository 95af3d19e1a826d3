"""Lua scripts shipped beside the package, read once and run by SHA.

Each script is ``scripts/prelude.lua`` followed by its own file, so helpers
such as ``append_event`` live in one place. A script is sent in full only when
the server answers NOSCRIPT (first use, or after a restart or SCRIPT FLUSH).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError

from .connections import Command, one_round_trip

KeyOrArg = str | bytes | int | float


class LuaScript:
    """One script: its text, its SHA1, and a call that loads it when needed."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.text = text
        # SHA-1: the name Redis gives a script (EVALSHA), not a choice.
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(
        self, client: redis.Redis, keys: Sequence[KeyOrArg], args: Sequence[KeyOrArg]
    ) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.text)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    def call_with(
        self,
        client: redis.Redis,
        keys: Sequence[KeyOrArg],
        args: Sequence[KeyOrArg],
        also: Sequence[Command],
    ) -> Any:
        """Run the script, and in the same round trip the commands ``also``.

        Those commands are best effort: their errors are ignored, and they run
        even when the script fails. They are sent once: when the script had to
        be loaded first, they are not sent again with it. Connection errors
        raise as usual.
        """
        return self.call_then(client, keys, args, (), also)[0]

    def call_then(
        self,
        client: redis.Redis,
        keys: Sequence[KeyOrArg],
        args: Sequence[KeyOrArg],
        then: Sequence[Command],
        also: Sequence[Command] = (),
    ) -> list[Any]:
        """Run the script, then the commands ``then`` and ``also`` on the same
        connection, in one round trip: the script's answer, then their replies
        (an error reply of theirs returned, not raised).

        ``then``: commands that must follow the script's write on its
        connection (``WAIT`` counts the replicas that hold this connection's
        writes): sent again with the script when it had to be loaded first,
        and their replies are from the run in which the script ran. ``also``:
        best-effort commands (an event's copy to the global stream) sent once,
        with the first try (an ``XADD`` sent again would add a second copy).

        On a cluster, two round trips: a cluster pipeline refuses scripts (and
        the other commands may be on another node anyway); the settings refuse
        WAIT there.
        """
        if isinstance(client, RedisCluster):
            replies: list[Any] = []
            try:
                answer = self(client, keys, args)
            finally:
                with contextlib.suppress(Exception):
                    replies = one_round_trip(client, [*then, *also])
            return [answer, *replies]
        evalsha: Command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        replies = one_round_trip(client, [evalsha, *then, *also])
        extra = replies[len(then) + 1:]
        if isinstance(replies[0], NoScriptError):
            client.script_load(self.text)
            replies = one_round_trip(client, [evalsha, *then])
        answer = replies[0]
        if isinstance(answer, NoScriptError):
            raise NoScriptError(f"script {self.name} could not be loaded")
        if isinstance(answer, Exception):
            raise answer
        return [answer, *replies[1:len(then) + 1], *extra]

    def call_many(
        self,
        client: redis.Redis,
        calls: Sequence[tuple[Sequence[KeyOrArg], Sequence[KeyOrArg]]],
        also: Sequence[Command] = (),
    ) -> list[Any]:
        """Run the script once per ``(keys, args)``, all in one round trip, and
        the commands ``also`` after them (best effort, as in :meth:`call_with`).

        Each run stays atomic; nothing binds the runs together. The answers
        come in order; a run's error is returned as its exception, not raised.
        Connection errors raise: any of the runs may have happened.
        """
        if not calls:
            return []
        if isinstance(client, RedisCluster):
            # A cluster pipeline refuses scripts: one round trip each there.
            answers: list[Any] = []
            for keys, args in calls:
                try:
                    answers.append(self(client, keys, args))
                except redis.ResponseError as exc:
                    answers.append(exc)
            with contextlib.suppress(Exception):
                one_round_trip(client, also)
            return answers
        commands: list[Command] = [("EVALSHA", self.sha, len(keys), *keys, *args)
                                   for keys, args in calls]
        answers = one_round_trip(client, [*commands, *also])[:len(commands)]
        missing = [i for i, answer in enumerate(answers) if isinstance(answer, NoScriptError)]
        if missing:
            client.script_load(self.text)
            for i, answer in zip(missing, one_round_trip(client, [commands[i] for i in missing]),
                                 strict=True):
                answers[i] = answer
        return answers

    def __repr__(self) -> str:
        return f"LuaScript({self.name!r}, sha={self.sha[:12]})"


def databases_argument(store_db: int, result_db: int | None, broker_db: int | None) -> str:
    """The databases argument of a script that stores a result or acknowledges
    a message (``prelude.lua``'s ``databases``): '' when both are in the
    store's database (None), else the three database numbers."""
    if result_db is None and broker_db is None:
        return ""
    return (f"{store_db} {store_db if result_db is None else result_db} "
            f"{store_db if broker_db is None else broker_db}")


@functools.cache
def script(name: str) -> LuaScript:
    """The script ``scripts/<name>.lua`` with the shared prelude, read once."""
    folder = resources.files("celery_tooleffect.store") / "scripts"
    prelude = (folder / "prelude.lua").read_text(encoding="utf-8")
    body = (folder / f"{name}.lua").read_text(encoding="utf-8")
    return LuaScript(name, f"{prelude}\n{body}")
