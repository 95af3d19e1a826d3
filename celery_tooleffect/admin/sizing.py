"""How big the store is and will be (:func:`measure_store`): its memory, its keys
by kind, the bytes a call leaves, and the memory projected at the current call
rate for the configured retention (``docs/redis.md#sizing-the-store``).

Every read is bounded: ``SCAN`` stops after ``sample`` keys (the counts of a
bigger store are extrapolated from ``DBSIZE``), bytes are ``MEMORY USAGE`` of
sampled keys only, at most ``runs`` runs are measured call by call, and the
rate is read from the newest ``window`` entries of the global audit stream. The
CLI (``tooleffect store --sizing``) and Flower's ``/metrics`` read it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from redis.cluster import RedisCluster

from ..store.audit import newest_copies
from ..store.chain import Element
from ..store.keys import Keys
from ..store.servers import address_of

if TYPE_CHECKING:
    from celery import Celery

    from ..store.runtime import ToolRuntime

#: The kinds of keys, in the order they are shown (docs/redis.md's key table).
JOURNAL = "journal entries"
#: A run's audit events, a list (its header holds the chain's head).
RUN_STREAMS = "run events"
GLOBAL_STREAM = "global stream"
DEAD_LETTERS = "dead letters"
APPROVALS = "approvals"
CLAIMS = "claims"
DECLARATIONS = "declarations"
ROLLBACK_WATCH = "rollback watch"
RESULTS = "celery results"
OTHER_PACKAGE = "other keys of the package"
NOT_THE_PACKAGES = "keys of others"
KINDS = (JOURNAL, RUN_STREAMS, GLOBAL_STREAM, DEAD_LETTERS, APPROVALS, CLAIMS,
         DECLARATIONS, ROLLBACK_WATCH, RESULTS, OTHER_PACKAGE, NOT_THE_PACKAGES)
#: The kinds a call leaves behind, each living the journal's retention.
PER_CALL = (JOURNAL, RUN_STREAMS, CLAIMS)

#: Defaults of the bounds (the CLI's ``--sample``, ``--runs``, ``--window``).
SAMPLE_KEYS = 10_000
SAMPLE_RUNS = 200
RATE_WINDOW = 1_000
#: The shortest time a rate is taken over: a burst of calls within the last
#: second is not read as a rate kept up all day.
MIN_RATE_SPAN = 60.0
#: Events read of one run at most, when its calls are measured.
RUN_EVENTS = 1_000


#: How the dead-letter keys in the slot ``{dlq}`` of a cluster store go on.
DLQ_TAILS = (":queue:", ":queues", ":where", ":index", ":by:", ":facets", ":counts",
             ":replaying")


def classify(key: str, prefix: str, results_prefix: str | None = None) -> str:
    """The kind of ``key`` (one of :data:`KINDS`), by its name alone."""
    if results_prefix and key.startswith(results_prefix):
        return RESULTS
    if not key.startswith(prefix):
        return NOT_THE_PACKAGES
    rest = key[len(prefix):]
    if rest.startswith("{"):
        # A hash tag: escaped, so its first "}" closes it.
        tag, _, tail = rest[1:].partition("}")
        # ``{dlq:<queue>}``: a queue's dead letters; ``{dlq}``: every
        # dead-letter key of a cluster store (store/keys.py). A run's own keys
        # end otherwise (a run may be named "dlq").
        if tag.startswith("dlq:") or (tag == "dlq" and tail.startswith(DLQ_TAILS)):
            return DEAD_LETTERS
        if tail.startswith(":journal:"):
            return JOURNAL
        if tail == ":events":
            return RUN_STREAMS
        if tail.startswith(":approval:"):
            return APPROVALS
        return OTHER_PACKAGE
    if rest == "events" or (rest.startswith("events:{") and rest.endswith("}")):
        return GLOBAL_STREAM  # one stream, or a cluster's shards (store/keys.py)
    for start, kind in (("dlq:", DEAD_LETTERS), ("approvals:", APPROVALS), ("call:{", CLAIMS),
                        ("workers:effects", DECLARATIONS), ("store:", ROLLBACK_WATCH)):
        if rest.startswith(start):
            return kind
    return OTHER_PACKAGE


@dataclass
class KindSize:
    """The keys of one kind: counted in the sample, and estimated for the store."""

    kind: str
    sampled: int = 0
    sampled_bytes: int = 0
    #: Sampled keys of the kind without a TTL (-1).
    without_ttl: int = 0
    keys: int = 0
    bytes: int = 0


@dataclass
class EffectSize:
    """The bytes the calls of one effect leave, measured on the runs sampled."""

    effect: str
    calls: int = 0
    bytes: int = 0

    @property
    def bytes_per_call(self) -> int:
        return round(self.bytes / self.calls) if self.calls else 0


@dataclass
class LetterSize:
    """The dead letters, every key of theirs measured (they are few: a handful
    per queue and per reason, failure class and effect)."""

    letters: int = 0
    keys: int = 0
    bytes: int = 0
    #: Whether they are kept in the store's Redis (else in the broker's).
    in_the_store: bool = True

    @property
    def bytes_per_letter(self) -> int:
        return round(self.bytes / self.letters) if self.letters else 0


@dataclass
class Sizing:
    """What :func:`measure_store` found."""

    server: str
    used_memory: int
    #: 0: no maxmemory set.
    maxmemory: int
    maxmemory_policy: str
    #: Keys of the store's database (``DBSIZE``), keys ``SCAN`` returned.
    total_keys: int
    scanned: int
    kinds: dict[str, KindSize]
    dead_letters: LetterSize
    #: The package's bytes per call by effect, and Celery's result per call.
    effects: dict[str, EffectSize]
    results: EffectSize
    #: Events of the runs measured per call, and bytes per event of the global stream.
    events_per_call: float
    bytes_per_global_event: int
    #: Calls per second over the newest entries of the global stream.
    calls_per_second: float
    rate_window_seconds: float
    #: How long a call's keys live (the journal's TTL), and Celery's results.
    retention_seconds: int
    result_expires_seconds: int
    global_stream_maxlen: int
    projected_memory: int
    warnings: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether every key was seen (nothing extrapolated)."""
        return self.scanned >= self.total_keys

    @property
    def bytes_per_call(self) -> int:
        """Bytes a call leaves, over every effect measured (0: none measured)."""
        calls = sum(size.calls for size in self.effects.values())
        return round(sum(size.bytes for size in self.effects.values()) / calls) if calls else 0

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["complete"] = self.complete
        data["bytes_per_call"] = self.bytes_per_call
        data["kinds"] = [asdict(size) for size in self.kinds.values()]
        data["effects"] = [dict(asdict(size), bytes_per_call=size.bytes_per_call)
                           for size in self.effects.values()]
        data["results"] = dict(asdict(self.results),
                               bytes_per_call=self.results.bytes_per_call)
        data["dead_letters"] = dict(asdict(self.dead_letters),
                                    bytes_per_letter=self.dead_letters.bytes_per_letter)
        return data


def measure_store(app: Celery, runtime: ToolRuntime, *, sample: int = SAMPLE_KEYS,
                  runs: int = SAMPLE_RUNS, window: int = RATE_WINDOW) -> Sizing:
    """Measure the store of ``app`` (bounded reads, see the module's docstring).

    The projection: what is not a call's (Redis itself, dead letters,
    approvals, queues) as it is now, plus ``calls/s x retention x bytes per
    call`` for the package's per-call keys, plus ``calls/s x result_expires x
    bytes per result`` for Celery's results kept in the store, plus the global
    stream at its cap. A projection past ``maxmemory`` is a warning.
    """
    if sample < 1 or runs < 0 or window < 1:
        raise ValueError("sample and window must be at least 1, runs at least 0")
    settings = runtime.settings
    client = runtime.audit.client
    keys = runtime.audit.keys
    prefix = settings.key_prefix
    results_prefix, result_expires, results_here = _results(app, runtime)
    memory = _memory(client)
    total = _dbsize(client)
    sampled = _scan(client, sample)
    kinds = {kind: KindSize(kind) for kind in KINDS}
    named = [(key, classify(key, prefix, results_prefix if results_here else None))
             for key in sampled]
    # Only the package's (and its results') keys are measured: an ACL may not
    # let the package see others'.
    measured = [(key, kind) for key, kind in named if kind != NOT_THE_PACKAGES]
    usages = _pipelined(client, [("MEMORY", "USAGE", key) for key, _ in measured])
    ttls = _pipelined(client, [("TTL", key) for key, _ in measured])
    for _, kind in named:
        kinds[kind].sampled += 1
    for (_, kind), usage, ttl in zip(measured, usages, ttls, strict=True):
        kinds[kind].sampled_bytes += int(usage or 0)
        if ttl == -1:
            kinds[kind].without_ttl += 1
    scale = total / len(sampled) if sampled and total > len(sampled) else 1.0
    for size in kinds.values():
        size.keys = round(size.sampled * scale)
        size.bytes = round(size.sampled_bytes * scale)
    # The global stream is one key (a cluster's: a few shards): measured
    # whether or not the sample met it.
    streams = keys.global_streams
    global_bytes = sum(int(usage or 0) for usage in _pipelined(
        client, [("MEMORY", "USAGE", stream) for stream in streams]))
    lengths = [int(length or 0) for length in _pipelined(
        client, [("XLEN", stream) for stream in streams])]
    global_events = sum(lengths)
    kinds[GLOBAL_STREAM].keys = sum(1 for length in lengths if length)
    kinds[GLOBAL_STREAM].bytes = global_bytes
    letters = _dead_letters(runtime, runtime.dead_letters.keys)
    if letters.in_the_store:
        kinds[DEAD_LETTERS].keys, kinds[DEAD_LETTERS].bytes = letters.keys, letters.bytes
    effects, results, events, calls = _per_effect(client, keys, [key for key, kind in named
                                                        if kind == RUN_STREAMS][:runs],
                                         app, results_here)
    rate, span = _rate(client, keys, window)
    sizing = Sizing(
        server=address_of(client), used_memory=memory.get("used_memory", 0),
        maxmemory=memory.get("maxmemory", 0),
        maxmemory_policy=str(memory.get("maxmemory_policy", "")),
        total_keys=total, scanned=len(sampled), kinds=kinds, dead_letters=letters,
        effects=effects, results=results,
        events_per_call=round(events / calls, 2) if calls else 0.0,
        bytes_per_global_event=round(global_bytes / global_events) if global_events else 0,
        calls_per_second=rate, rate_window_seconds=span,
        retention_seconds=settings.journal_ttl, result_expires_seconds=result_expires,
        global_stream_maxlen=settings.global_stream_maxlen, projected_memory=0,
    )
    sizing.projected_memory, sizing.warnings = measure_projection(sizing)
    return sizing


def measure_projection(sizing: Sizing) -> tuple[int, list[str]]:
    """The memory ``sizing`` projects (see :func:`measure_store`) and what the
    operator is warned of: a projection past ``maxmemory``, per-call keys
    without a TTL, an extrapolated sample."""
    projected = _projected(sizing)
    return projected, _warnings(sizing, projected)


def _projected(sizing: Sizing) -> int:
    per_call_now = sum(sizing.kinds[kind].bytes for kind in PER_CALL)
    results_now = sizing.kinds[RESULTS].bytes
    global_now = sizing.kinds[GLOBAL_STREAM].bytes
    fixed = max(sizing.used_memory - per_call_now - results_now - global_now, 0)
    per_result = sizing.results.bytes_per_call
    per_call = sizing.bytes_per_call
    rate = sizing.calls_per_second
    global_events = min(sizing.global_stream_maxlen,
                        rate * max(sizing.events_per_call, 1.0) * sizing.retention_seconds)
    if not global_events and global_now:
        global_part = float(global_now)
    else:
        global_part = global_events * sizing.bytes_per_global_event
    return round(fixed + rate * sizing.retention_seconds * per_call
                 + rate * sizing.result_expires_seconds * per_result + global_part)


def _warnings(sizing: Sizing, projected: int) -> list[str]:
    found = []
    if sizing.maxmemory and projected > sizing.maxmemory:
        found.append(
            f"at {sizing.calls_per_second:.2f} calls/s for the retention "
            f"({days(sizing.retention_seconds)}) the store would need about "
            f"{human_bytes(projected)}, more than its maxmemory "
            f"({human_bytes(sizing.maxmemory)}): a full noeviction store fails every write "
            "closed; raise maxmemory or lower tooleffect_retention")
    without = [size.kind for size in sizing.kinds.values()
               if size.without_ttl and size.kind in PER_CALL]
    if without:
        found.append(f"keys without a TTL among the {', '.join(without)}: they never expire")
    if not sizing.complete:
        found.append(f"sampled {sizing.scanned} of {sizing.total_keys} keys: counts and bytes "
                     "by kind are extrapolated")
    return found


def days(seconds: float) -> str:
    """``seconds`` as ``7 days`` (or ``600 s`` under a day)."""
    return f"{seconds / 86400:g} days" if seconds >= 86400 else f"{seconds:g} s"


def human_bytes(value: float) -> str:
    """``value`` bytes as ``12.3 MB`` (powers of 1000, as Redis's own ``mb``)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value} TB"


# -- reads ---------------------------------------------------------------------------


def _nodes(client: Any) -> list[Any]:
    if isinstance(client, RedisCluster):
        return [client.get_redis_connection(node)
                for node in client.get_primaries()]  # type: ignore[no-untyped-call]
    return [client]


def _memory(client: Any) -> dict[str, Any]:
    found: dict[str, Any] = {"used_memory": 0, "maxmemory": 0}
    for node in _nodes(client):
        info = node.info("memory")
        found["used_memory"] += int(info.get("used_memory", 0))
        found["maxmemory"] += int(info.get("maxmemory", 0))
        found["maxmemory_policy"] = info.get("maxmemory_policy", "")
    return found


def _dbsize(client: Any) -> int:
    return sum(int(node.dbsize()) for node in _nodes(client))


def _scan(client: Any, sample: int) -> list[str]:
    """At most ``sample`` key names (``SCAN``, spread over a cluster's primaries)."""
    nodes = _nodes(client)
    found: list[str] = []
    share = max(sample // len(nodes), 1)
    for node in nodes:
        cursor, seen = 0, 0
        while seen < share:
            cursor, names = node.scan(cursor, count=min(1000, share))
            for name in names[: share - seen]:
                found.append(name.decode() if isinstance(name, bytes) else str(name))
            seen += len(names)
            if not cursor:
                break
    return found


def _pipelined(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    if not commands:
        return []
    found: list[Any] = []
    for start in range(0, len(commands), 500):
        pipe = client.pipeline(transaction=False)
        for command in commands[start:start + 500]:
            pipe.execute_command(*command)
        found += pipe.execute(raise_on_error=False)
    return [None if isinstance(value, Exception) else value for value in found]


def _dead_letters(runtime: ToolRuntime, keys: Keys) -> LetterSize:
    """Every dead-letter key, found from the queues and facets they list."""
    client = runtime.dead_letters.client
    store = runtime.audit.client
    found = LetterSize(in_the_store=client is store or (
        runtime.settings.dead_letter_url == runtime.settings.redis_url))
    queues = sorted(_text(queue) for queue in client.smembers(keys.dead_letter_queues))
    facets = sorted(_text(facet) for facet in client.smembers(keys.dead_letter_facets))
    names = [keys.dead_letter_queues, keys.dead_letter_locations, keys.dead_letter_all,
             keys.dead_letter_facets, keys.dead_letter_counts, keys.dead_letter_replaying,
             *(keys.dead_letters(queue) for queue in queues),
             *(keys.dead_letter_index(queue) for queue in queues),
             *(keys.dead_letter_facet(*facet.split(":", 1)) for facet in facets
               if ":" in facet)]
    usages = _pipelined(client, [("MEMORY", "USAGE", name) for name in names])
    counts = _pipelined(client, [("HLEN", keys.dead_letters(queue)) for queue in queues])
    found.keys = sum(1 for usage in usages if usage)
    found.bytes = sum(int(usage or 0) for usage in usages)
    found.letters = sum(int(count or 0) for count in counts)
    return found


def _results(app: Celery, runtime: ToolRuntime) -> tuple[str | None, int, bool]:
    """The key prefix of Celery's results, their lifetime in seconds, and whether
    they are kept in the store's database."""
    backend = app.backend
    key_prefix = getattr(backend, "task_keyprefix", None)
    expires: Any = getattr(backend, "expires", None)
    seconds = int(expires.total_seconds() if hasattr(expires, "total_seconds")
                  else (expires or 0))
    if key_prefix is None or not hasattr(backend, "client"):
        return None, seconds, False
    kwargs = getattr(getattr(backend.client, "connection_pool", None), "connection_kwargs", {})
    store = getattr(getattr(runtime.audit.client, "connection_pool", None),
                    "connection_kwargs", {})
    here = bool(kwargs) and all(kwargs.get(name) == store.get(name)
                                for name in ("host", "port", "path", "db"))
    text = key_prefix.decode() if isinstance(key_prefix, bytes) else str(key_prefix)
    return text, seconds, here


def _per_effect(client: Any, keys: Keys, streams: list[str], app: Celery,
                results_here: bool) -> tuple[dict[str, EffectSize], EffectSize, int, int]:
    """Bytes per call by effect, measured on the runs of ``streams``: a call's
    own keys (journal entry, approval, claim) plus its share of its run's
    events; and Celery's results of those calls (when kept in the
    store). Also the events and calls read."""
    effects: dict[str, EffectSize] = {}
    results = EffectSize(RESULTS)
    events = calls = 0
    if not streams:
        return effects, results, events, calls
    entries = _pipelined(client, [("LRANGE", stream, 1, RUN_EVENTS) for stream in streams])
    runs = []
    for stream, read in zip(streams, entries, strict=True):
        by_task: dict[str, str] = {}
        element: Element | None = None
        for number, raw in enumerate(read or [], 1):
            element = Element.parse(number, bytes(raw), element)
            values = element.fields("")
            task = values.get("task_id", "")
            if task:
                by_task.setdefault(task, values.get("effect", "") or "unknown")
                if values.get("effect"):
                    by_task[task] = values["effect"]
        events += len(read or [])
        if by_task:
            runs.append((stream, by_task))
    commands: list[tuple[Any, ...]] = []
    for stream, by_task in runs:
        run = stream[: -len(":events")]
        commands.append(("MEMORY", "USAGE", stream))
        for task in by_task:
            commands += [("MEMORY", "USAGE", f"{run}:journal:{task}"),
                         ("MEMORY", "USAGE", f"{run}:approval:{task}"),
                         ("MEMORY", "USAGE", keys.call_claim(task))]
            if results_here:
                commands.append(("MEMORY", "USAGE", app.backend.get_key_for_task(task)))
    usages = iter(_pipelined(client, commands))
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for _, by_task in runs:
        shared = int(next(usages) or 0)
        for effect in by_task.values():
            own = sum(int(next(usages) or 0) for _ in range(3))
            totals[effect][0] += 1
            totals[effect][1] += own + round(shared / len(by_task))
            calls += 1
            if results_here:
                result = int(next(usages) or 0)
                if result:
                    results.calls += 1
                    results.bytes += result
    for effect, (count, total) in sorted(totals.items()):
        effects[effect] = EffectSize(effect, count, total)
    return effects, results, events, calls


def _rate(client: Any, keys: Keys, window: int) -> tuple[float, float]:
    """Calls per second over the newest ``window`` entries of the global stream
    (distinct task ids over the time since the oldest of them, at least
    :data:`MIN_RATE_SPAN`), and that time."""
    entries = newest_copies(client, keys.global_streams, window)
    if not entries:
        return 0.0, 0.0
    tasks = set()
    for _, fields in entries:
        values = {_text(k): _text(v) for k, v in _pairs(fields)}
        tasks.add(values.get("task_id", ""))
    oldest = int(_text(entries[-1][0]).split("-")[0]) / 1000
    span = max(time.time() - oldest, MIN_RATE_SPAN)
    return round(len(tasks - {""}) / span, 4), round(span, 1)


def _pairs(fields: Any) -> list[tuple[Any, Any]]:
    if isinstance(fields, dict):
        return list(fields.items())
    return list(zip(fields[::2], fields[1::2], strict=True))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
