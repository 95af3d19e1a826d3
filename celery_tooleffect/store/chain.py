"""How a run's audit events are kept: one Redis list per run, one element per
event, and the chain that ``audit verify`` checks (docs/operations.md#audit-verify).

The list ``P{<run_id>}:events`` holds, at index 0, the run's **header**::

    te1 <seq> <head> <base_seq> <base>

``seq`` is the number of the newest event (1 = the run's first), ``head`` the
chain's link after it, ``base_seq`` and ``base`` the number and link of the
newest event trimmed away (``0`` and ``-`` while none was). Each later element
is one event::

    <sum: 8 hex><link: 8 hex><body>

``body`` is the event's fields, each name and value written
``<byte length>:<bytes>`` one after the other (:func:`canonical`): first the
fields its writer sent, in their order, without ``run_id`` (the key names the
run); the writer's keyed ``mac`` is the last of them when
``tooleffect_audit_key`` is set; then the fields the storing script added
(the verdict of ``begin_attempt``, a late outcome's phase, ...), their names
marked ``+``. ``sum`` is the start of the SHA-1 of ``body``; ``link`` the
start of the chain's link, ``SHA-1(previous link + body)`` in hex (the first
event's previous link is ``''``, or ``base`` after a trim). Event ``n`` is
element ``n - base_seq``. The element's number is its ``seq``, and its id.

The common field names are stored as one character (:data:`CODES`), and a
write's outcome leaves out what its intent just before it said
(:data:`INHERITED`); readers put both back.

The ``mac`` is HMAC-SHA256 under the operator's key, of the canonical form of
the fields as sent with ``run_id``, sorted by name, its first 16 bytes in
base64url (:func:`seal`): the worker (or operator) computes it, the store never holds the
key. The links are computed inside Redis (Lua has only SHA-1), where the
previous link is at hand without a round trip.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

HEADER_TAG = b"te1"
#: The name of the keyed MAC among an event's fields.
MAC_FIELD = "mac"
#: HMAC-SHA256 kept to 128 bits (RFC 2104 section 5: at least half the
#: output), written in unpadded base64url (22 characters).
MAC_BYTES = 16
#: Hex digits of the body's SHA-1 and of the link kept in each element.
SHORT = 8
#: Fields an event leaves out when the element before it is a full event (it
#: names its task_id) of the same task with the same values: a write's
#: outcome after its intent (prelude.lua's ``inherited``).
INHERITED = ("task_id", "tool", "effect", "worker", "queue", "redelivered")
#: The one-character names the common fields are stored under (prelude.lua's
#: ``codes``). Any other name of one character, or starting with ``=`` or
#: ``+``, is stored after a ``=``.
CODES = {
    "task_id": "t", "tool": "o", "effect": "e", "phase": "p", "status": "s", "worker": "w",
    "queue": "q", "redelivered": "r", "ts": "T", "attempt": "a", "duration_ms": "d",
    "failure_class": "f", "exception_type": "x", "args_size": "A", "kwargs_size": "K",
    "result_size": "R", "error_size": "E", "idempotency_key": "i", "fencing_token": "F",
    "reclaimed": "c", "mac": "m", "actor": "y", "reason": "n", "late_phase": "L",
    "journal_state": "J", "previous_state": "P", "attempts_before": "B",
    "lease_until": "U", "dead_letter_reason": "D",
}
_NAMES = {code: name for name, code in CODES.items()}


def read_name(stored: str) -> tuple[str, bool]:
    """A stored field name read back: the name, and whether the storing
    script added the field (``+``)."""
    if stored.startswith("="):
        return stored[1:], False
    if stored.startswith("+"):
        return read_name(stored[1:])[0], True
    if len(stored) == 1:
        return _NAMES.get(stored, stored), False
    return stored, False
#: Where the fields of an event go when it is read back (the others follow in
#: stored order).
_ORDER = {name: at for at, name in enumerate(
    ("task_id", "tool", "effect", "phase", "status", "worker", "queue", "redelivered", "ts"))}


def stored(values: Iterable[bytes | str] | None) -> list[bytes]:
    """A run's list as Redis answered it, as bytes."""
    return [_bytes(value) for value in values or []]


def canonical(items: Iterable[bytes]) -> bytes:
    """``items`` each written ``<byte length>:<bytes>``, one after the other."""
    return b"".join(b"%d:%s" % (len(item), item) for item in items)


def parse(body: bytes) -> list[tuple[str, str]]:
    """The ``(name, value)`` pairs of a :func:`canonical` body, as text.

    Raises ValueError when ``body`` is not one (an element edited by hand).
    """
    items: list[bytes] = []
    at, end = 0, len(body)
    while at < end:
        colon = body.index(b":", at)
        length = int(body[at:colon])
        if length < 0 or colon + 1 + length > end:
            raise ValueError("a length past the end of the event")
        items.append(body[colon + 1:colon + 1 + length])
        at = colon + 1 + length
    if len(items) % 2:
        raise ValueError("a name without a value")
    return [(items[i].decode("utf-8", "replace"), items[i + 1].decode("utf-8", "replace"))
            for i in range(0, len(items), 2)]


def link(previous: str, body: bytes) -> str:
    """The chain's link after an event of ``body``, ``previous`` the link before it."""
    return hashlib.sha1(previous.encode() + body).hexdigest()


def body_sum(body: bytes) -> str:
    """The part of an event's element that says its body is what was stored."""
    return hashlib.sha1(body).hexdigest()[:SHORT]


def _bytes(value: str | bytes) -> bytes:
    """``value`` as the store's clients send it: text that is not valid UTF-8
    (a lone surrogate from a JSON message) escaped (connections.py)."""
    return value if isinstance(value, bytes) else value.encode("utf-8", "backslashreplace")


def mac_input(run_id: str, sent: Sequence[tuple[str, str]]) -> bytes:
    """What an event's MAC is computed over: ``run_id`` and the fields as sent
    (any ``run_id`` among them and the MAC itself left out), sorted by name
    (an outcome stored without what its intent said is read back whole, in
    another order), canonical."""
    pairs = sorted([(b"run_id", _bytes(run_id))] + [
        (_bytes(name), _bytes(value)) for name, value in sent
        if name not in ("run_id", MAC_FIELD)])
    return canonical(item for pair in pairs for item in pair)


def _mac(key: bytes, run_id: str, sent: Sequence[tuple[str, str]]) -> str:
    digest = hmac.new(key, mac_input(run_id, sent), hashlib.sha256).digest()[:MAC_BYTES]
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def seal(key: bytes, run_id: str, flat: Sequence[str]) -> str:
    """The MAC of an event sent as the flat fields ``flat`` (``[name, value, ...]``)."""
    return _mac(key, run_id, list(zip(flat[::2], flat[1::2], strict=True)))


def mac_matches(key: bytes, run_id: str, sent: Sequence[tuple[str, str]], mac: str) -> bool:
    """Whether ``mac`` is the MAC of the fields ``sent`` of run ``run_id``."""
    return hmac.compare_digest(_mac(key, run_id, sent), mac)


@dataclass(frozen=True)
class Header:
    """A run's header: its newest event's number and link, and the newest trimmed one's."""

    seq: int
    head: str
    base_seq: int
    base: str

    @classmethod
    def parse(cls, raw: bytes | None) -> Header | None:
        """The header stored as ``raw``; None when it is not one."""
        if raw is None:
            return None
        parts = raw.split(b" ")
        if len(parts) != 5 or parts[0] != HEADER_TAG:
            return None
        try:
            seq, base_seq = int(parts[1]), int(parts[3])
        except ValueError:
            return None
        head, base = parts[2].decode(), parts[4].decode()
        return cls(seq, "" if head == "-" else head, base_seq, "" if base == "-" else base)


@dataclass(frozen=True)
class Element:
    """One stored event, split: its number, body, the sums it carries, its
    fields as sent (those it took from the event before it included) and as
    the script added them."""

    seq: int
    body: bytes
    stored_sum: str
    stored_link: str
    sent: list[tuple[str, str]]
    added: list[tuple[str, str]]

    #: Whether it names its task (else it took :data:`INHERITED` from the
    #: element before it).
    full: bool = True

    @classmethod
    def parse(cls, seq: int, raw: bytes, previous: Element | None = None) -> Element:
        """Element ``raw`` as event number ``seq``, ``previous`` the element
        before it (None: none read); its fields empty when its body is not
        canonical (its sum then says it was altered)."""
        body = raw[2 * SHORT:]
        try:
            pairs = parse(body)
        except ValueError:
            pairs = []
        stored: list[tuple[str, str]] = []
        added: list[tuple[str, str]] = []
        for raw_name, value in pairs:
            name, by_script = read_name(raw_name)
            (added if by_script else stored).append((name, value))
        names = {name for name, _ in stored}
        full = "task_id" in names
        if not full and previous is not None and previous.full:
            before = dict(previous.sent)
            stored += [(name, before[name]) for name in INHERITED
                       if name not in names and name in before]
            stored.sort(key=lambda pair: _ORDER.get(pair[0], len(_ORDER)))
        return cls(seq, body, raw[:SHORT].decode("ascii", "replace"),
                   raw[SHORT:2 * SHORT].decode("ascii", "replace"), stored, added, full)

    def fields(self, run_id: str) -> dict[str, str]:
        """The event's fields as readers see them: ``run_id``, the fields sent,
        each replaced by the value the script added in its place, then the
        added ones the writer did not send."""
        fields = {"run_id": _bytes(run_id).decode("utf-8"), **dict(self.sent)}
        fields.update(self.added)
        return fields

    @property
    def mac(self) -> str | None:
        return dict(self.sent).get(MAC_FIELD)


@dataclass(frozen=True)
class ChainCheck:
    """What ``audit verify`` found in one run's events (:func:`check_chain`)."""

    run_id: str
    events: int
    #: The first broken link: the event's seq (``header``: the run's header,
    #: ``end``: past the last event), and what is wrong with it.
    broken_at: str | None = None
    problem: str | None = None
    #: Events whose keyed MAC was checked (0 without ``tooleffect_audit_key``).
    keyed: int = 0
    #: The run's head as its header holds it: its newest event's seq and link.
    head_seq: int = 0
    head: str = ""

    @property
    def intact(self) -> bool:
        return self.broken_at is None


def head_of(raw: Sequence[bytes]) -> tuple[int, str] | None:
    """The (seq, link) a run's header names, from its list ``raw``; None without one."""
    header = Header.parse(raw[0]) if raw else None
    return None if header is None else (header.seq, header.head)


def check_chain(run_id: str, raw: Sequence[bytes], *, key: bytes | None = None,
                exported: tuple[int, str] | None = None) -> ChainCheck:
    """Check a run's events, its list ``raw`` (header first); report the first
    broken link (docs/operations.md#audit-verify says what each finds).

    Each event's sum (its body as stored), with ``key`` its MAC (its fields as
    their writer sent them), its link (the event before it), that no body is
    stored twice, then the header (the newest events), and with ``exported``
    (a head taken earlier) the link at that seq.
    """
    header = Header.parse(raw[0]) if raw else None
    elements = raw[1:] if header is not None else raw
    base_seq, previous = (header.base_seq, header.base) if header else (0, "")
    head_seq, head = (header.seq, header.head) if header else (0, "")
    checked = 0

    def broken(where: str, problem: str) -> ChainCheck:
        return ChainCheck(run_id, len(elements), where, problem, checked, head_seq, head)

    seen: dict[bytes, int] = {}
    before: Element | None = None
    for number, raw_element in enumerate(elements, 1):
        seq = base_seq + number
        element = before = Element.parse(seq, raw_element, before)
        where = str(seq)
        if body_sum(element.body) != element.stored_sum:
            return broken(where, "event was altered")
        if key is not None:
            if element.mac is None:
                return broken(where, "event has no MAC: not stored by a holder of the audit key")
            if not mac_matches(key, run_id, element.sent, element.mac):
                return broken(where, "event was altered or forged: its MAC does not match")
            checked += 1
        current = link(previous, element.body)
        if current[:SHORT] != element.stored_link:
            return broken(where, "the event before it is missing or was altered")
        if element.body in seen:
            return broken(where, f"event repeats event {seen[element.body]}")
        seen[element.body] = seq
        if exported is not None and exported[0] == seq and current != exported[1]:
            return broken(where, "the chain differs from the exported head: an event up to "
                                 "it was altered, removed, moved or inserted")
        previous = current
    end = base_seq + len(elements)
    if header is None:
        if not elements:
            if exported is not None and exported[0] > 0:
                return broken("end", f"the run has no events, the exported head names seq "
                                     f"{exported[0]}: they were deleted")
            return ChainCheck(run_id, 0)
        return broken("header", "the run's header is missing or was altered")
    if head_seq != end or head != previous:
        return broken("end", "newer events were deleted" if head_seq > end
                      else "the header does not match the events")
    if exported is not None:
        seq, value = exported
        if seq > end:
            return broken("end", f"the run ends before the exported head (seq {seq}): "
                                 "events were deleted")
        if seq < base_seq or (seq == base_seq and value != header.base):
            return broken("header", f"the exported head (seq {seq}) is no longer stored: "
                                    "trimmed, or deleted")
    return ChainCheck(run_id, len(elements), None, None, checked, head_seq, head)
