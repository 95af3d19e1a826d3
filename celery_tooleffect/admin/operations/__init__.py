"""What operators do with dead letters: replay, purge, reconcile, count, and how
a letter is shown.

The CLI (:mod:`celery_tooleffect.admin.cli`) and the Flower pages
(:mod:`celery_tooleffect.admin.flower`) both call :class:`DeadLetterOperations`, so
the rules below hold wherever an operator acts. One concern a module:

- :mod:`.results`: who acts, and how an action on one task ended (:class:`ActionResult`);
- :mod:`.stores`: the one line told when a store or the broker is away;
- :mod:`.rules`: whether a letter may be replayed or reconciled, and why not;
- :mod:`.views`: the JSON of a listing (:func:`letter_listing`, the one listing
  view), a listed letter and one letter in full;
- :mod:`.base`, :mod:`.replay`, :mod:`.reconcile`, :mod:`.purge`: the
  actions, which :class:`DeadLetterOperations` puts together.

Replay
    One audited step: the letter is taken out of the store (atomically, so of
    two operators replaying the same task one wins), the journal of a write is
    reset under a new attempt token (state ``replayed``, attempt 0: the task
    has its whole attempt budget again, and any worker of an earlier attempt
    is fenced off) in the same script that appends the ``replayed`` audit
    event with the actor, the reason and the time; then the envelope is
    published again to its queue with the same task id, name, arguments, run
    id header and options (``retries`` 0). A READ_ONLY tool keeps no journal:
    its ``replayed`` event is appended alone, and the replay is not made when
    that event cannot be stored. When anything fails before the message is
    published, the letter goes back to the store and the journal back to
    ``dead_lettered``: a replay either happens, audited, or leaves things as
    they were.

    - READ_ONLY and IDEMPOTENT_WRITE may be replayed in bulk.
    - A NON_IDEMPOTENT_WRITE is replayed only by its task id, one at a time,
      with ``force`` and a reason. It is refused, even with ``force``, when its
      outcome was recorded: journal ``succeeded``, or a ``late_outcome`` (on
      the letter or in the run's audit events).
    - A letter whose ``body_completed`` is true (``AuditPersistenceFailed``
      after the body succeeded) is refused with a message that says the write
      already ran; only ``force`` with a reason overrides that.
    - A message that could not be decoded has nothing to publish: refused.

Purge
    Removes the letter after appending a ``purged`` audit event (actor,
    reason, time); when the event cannot be stored the letter stays. The
    journal of a purged write keeps its state, so a stray copy of the message
    is still acknowledged without running until the entry expires.

Unreachable stores
    :func:`explain` turns what an action raised when a store it needs is down
    or refuses (or the broker is, or the settings are invalid) into the one
    line the CLI prints and Flower answers; :func:`store_problem` PINGs the
    stores an action needs first, and names the one that does not answer by
    its URL, without password.

Reconcile
    Asks the tool of a letter whose write may have happened whether it did
    (its ``reconcile``): applied settles SUCCESS and removes the letter, not
    applied replays it (a revoked one stays), unknown leaves it; audited with
    the evidence.

Privacy
    Listings (:func:`letter_summary`) follow ``tooleffect_privacy`` like the
    audit log: at ``metadata`` they show sizes of the arguments and the error,
    never their values. Showing one letter (:func:`letter_detail`) gives the
    whole envelope, which a replay needs: whoever may show a letter may read it.
"""

from .purge import Purging
from .reconcile import Reconciling
from .replay import ABANDONED_AFTER, publish
from .results import ACTOR_ENV, REASON_LIMIT, ActionResult, Outcome, default_actor, results_summary
from .rules import RECONCILABLE, letter_effect, reconcile_refusal, replay_refusal
from .stores import (
    BOTH_STORES,
    BROKER_ERRORS,
    DEAD_LETTER_STORE,
    STORE,
    STORE_ERRORS,
    explain,
    store_problem,
)
from .views import letter_detail, letter_listing, letter_summary, letter_view

__all__ = [
    "ABANDONED_AFTER",
    "ACTOR_ENV",
    "BOTH_STORES",
    "BROKER_ERRORS",
    "DEAD_LETTER_STORE",
    "REASON_LIMIT",
    "RECONCILABLE",
    "STORE",
    "STORE_ERRORS",
    "ActionResult",
    "DeadLetterOperations",
    "Outcome",
    "default_actor",
    "explain",
    "letter_detail",
    "letter_effect",
    "letter_listing",
    "letter_summary",
    "letter_view",
    "publish",
    "reconcile_refusal",
    "replay_refusal",
    "results_summary",
    "store_problem",
]


class DeadLetterOperations(Reconciling, Purging):
    """List, show, replay, reconcile, purge and count the dead letters of one app
    (see the package docs)."""
