"""How a dead letter is shown: the stable JSON of the CLI's ``--json``, of
Flower's JSON API, and what Flower's pages render.

:func:`letter_listing` is the one listing view: a page of letters as
``dlq list --json`` prints it, ``GET /api/dead-letters`` answers it and the
Dead letters page renders its rows. Listings (:func:`letter_summary`, a row)
follow ``tooleffect_privacy`` like the audit log: at ``metadata`` they show
sizes of the arguments and the error, never their values. Showing one letter
(:func:`letter_detail`) gives the whole envelope, which a replay needs:
whoever may show a letter may read it.
"""

from __future__ import annotations

from typing import Any

from ...store.audit import MASK, describe_payload
from ...store.dead_letter_queries import DeadLetterPage
from ...store.dead_letter_record import DeadLetter
from ...store.envelope import shown
from .rules import replay_refusal


def letter_listing(page: DeadLetterPage, privacy: str, accept: Any = None) -> dict[str, Any]:
    """One page of letters, as the stable JSON of ``dlq list --json`` and
    ``/api/dead-letters``: ``{"dead_letters": [letter_summary...], "next_cursor":
    "..." | null, "total": N | null}`` (``next_cursor``: null on the last page;
    ``total``: null when not known without a walk)."""
    return {
        "dead_letters": [letter_summary(letter, privacy, accept) for letter in page.letters],
        "next_cursor": page.next_cursor.encode() if page.next_cursor else None,
        "total": page.total,
    }


def letter_summary(letter: DeadLetter, privacy: str, accept: Any = None) -> dict[str, Any]:
    """One listed letter, as the stable JSON of ``dlq list`` and ``/api/dead-letters``.

    Arguments (decoded from the body with ``accept``, the app's
    ``accept_content``) and the error message follow ``privacy``: at
    ``metadata`` only their sizes (``args_size``, ``kwargs_size``,
    ``error_size``). A body that cannot be decoded adds ``decode_error``.
    """
    summary: dict[str, Any] = {
        "task_id": letter.task_id,
        "name": letter.name,
        "queue": letter.queue,
        "reason": letter.reason,
        "failure_class": letter.failure_class,
        "effect": letter.effect,
        "exception_type": letter.exception_type,
        "attempts": letter.attempts,
        "worker": letter.worker,
        "run_id": letter.run_id,
        "body_completed": letter.body_completed,
        "late_outcomes": len(letter.late_outcomes),
        "dead_lettered_at": letter.dead_lettered_at,
    }
    args, kwargs, _, problem = _decoded_payload(letter, accept)
    if problem:
        summary["decode_error"] = problem
    for name, value in describe_payload(privacy, args=shown(args), kwargs=shown(kwargs)).items():
        summary[name] = int(value) if name.endswith("_size") else value
    if privacy == "full":
        summary["error"] = letter.error
    elif privacy == "redacted":
        summary["error"] = MASK if letter.error else ""
    else:
        summary["error_size"] = len(letter.error.encode("utf-8", "replace"))
    return summary


def letter_detail(
    letter: DeadLetter, journal: dict[str, str] | None, *, taken: bool = False,
    accept: Any = None, chord_refusal: str | None = None, page: bool = False,
) -> dict[str, Any]:
    """One letter in full, as the stable JSON of ``dlq show`` and ``/api/dead-letters/<id>``
    (``page``: refusals in the words of Flower's page).

    ``dead_letter`` is :func:`letter_view`. ``replay`` previews the rules:
    ``allowed`` (without force), ``needs_force`` and the ``refusal`` a plain
    replay would get.
    """
    state = (journal or {}).get("state")
    plain = chord_refusal or replay_refusal(letter, force=False, reason="", bulk=False,
                                            journal_state=state, page=page)
    forced = chord_refusal or replay_refusal(letter, force=True, reason="why", bulk=False,
                                             journal_state=state, page=page)
    bulk = chord_refusal or replay_refusal(letter, force=False, reason="", bulk=True,
                                           journal_state=state, page=page)
    return {
        "dead_letter": letter_view(letter, accept),
        "journal": journal or None,
        "replay_in_progress": taken,
        "replay": {
            "allowed": plain is None,
            "needs_force": plain is not None and forced is None,
            "bulk": bulk is None,
            "refusal": plain,
        },
    }


def letter_view(letter: DeadLetter, accept: Any = None) -> dict[str, Any]:
    """A letter as operators see it: JSON-safe, decoded for display only.

    ``args``, ``kwargs`` and ``canvas`` (callbacks, errbacks, chain, chord)
    are decoded from the kept body with kombu's serializers for the content
    types ``accept`` allows; a value JSON has no type for is shown as
    ``{"$text": repr, "$type": type}``. ``message`` shows the headers,
    properties and routing as delivered and the body's size; the body itself
    (base64) only when it could not be decoded. Nothing shown is written back.
    """
    data = letter.to_dict()
    message = data.pop("message")
    args, kwargs, embed, problem = _decoded_payload(letter, accept)
    data.update(args=shown(args), kwargs=shown(kwargs),
                canvas=shown({key: value for key, value in embed.items() if value}),
                decode_error=problem)
    if letter.message is not None:
        envelope = letter.message
        data["message"] = {
            "protocol": envelope.protocol,
            "content_type": envelope.content_type,
            "content_encoding": envelope.content_encoding,
            "headers": shown(dict(envelope.headers)),
            "properties": shown(dict(envelope.properties)),
            "exchange": envelope.exchange,
            "routing_key": envelope.routing_key,
            "body_size": len(envelope.body),
            "body_base64": message["body"] if problem else None,
        }
    else:
        data["message"] = None
    return data


def _decoded_payload(
    letter: DeadLetter, accept: Any
) -> tuple[list[Any], dict[str, Any], dict[str, Any], str | None]:
    """``(args, kwargs, embed, problem)``: the decoded body, or empty values and why not.

    ``accept`` None means Celery's default (JSON only), never "anything".
    """
    try:
        args, kwargs, embed = letter.payload(accept if accept is not None else ("json",))
    except Exception as exc:
        return [], {}, {}, f"body not decoded: {type(exc).__name__}: {exc}"
    return args, kwargs, embed, None
