"""Flower 2.x with "Dead letters" and "Approvals" pages, their JSON APIs, and gauges.

``celery -A app tooleffect flower [flower options]`` starts Flower exactly as
``celery -A app flower`` does (same options, environment variables, config
file, authentication, TLS and URL prefix), plus:

- a **Dead letters** tab in Flower's navigation: the list with filters (queue,
  dead-letter reason, failure class, effect) and paging, one letter's details,
  and replay and purge buttons under the rules of
  :mod:`celery_tooleffect.admin.operations` (:mod:`.dead_letters`). A
  NON_IDEMPOTENT_WRITE (or a write whose body completed) is replayed only
  when the operator ticks a confirmation and gives a reason; without them the
  page shows the refusal and nothing is published;
- the JSON API::

      GET  /api/dead-letters?queue=&dead_letter_reason=&failure_class=&effect=&limit=&cursor=
      GET  /api/dead-letters/stats
      GET  /api/dead-letters/<task_id>
      POST /api/dead-letters/<task_id>/replay   {"force": false, "reason": ""}
      POST /api/dead-letters/<task_id>/purge    {"reason": ""}
      POST /api/dead-letters/<task_id>/reconcile  {}

  with the same JSON as the CLI's ``--json`` (replay and purge answer one
  result: 200 done, 409 refused, 404 not found, 503 failed). As in the CLI,
  ``dead_letter_reason`` filters and ``reason`` is only the operator's why,
  written in the audit event of a replay or purge (a list request with a
  ``reason`` is refused with 400);
- an **Approvals** tab: the calls parked until a person approves them
  (:mod:`celery_tooleffect.admin.approvals`), with filters (queue, tool) and
  paging, one call's details, and Approve and Reject forms, each with a
  reason (a rejection needs one); and its JSON API::

      GET  /api/approvals?queue=&tool=&state=&limit=&offset=
      GET  /api/approvals/stats
      GET  /api/approvals/<task_id>
      POST /api/approvals/<task_id>/approve   {"reason": ""}
      POST /api/approvals/<task_id>/reject    {"reason": "..."}

  (a decision answers one result, with the status codes of a replay);
- gauges on Flower's ``/metrics``, read from the store at each scrape
  (:class:`.metrics.StoreGauges`): ``tooleffect_approvals_pending{queue,tool}``, the
  calls awaiting a decision; ``tooleffect_dead_letters{queue,reason,
  failure_class,effect}``, the dead letters of each combination; and
  ``tooleffect_oldest_dead_letter_age_seconds{queue}``, how long the oldest
  dead letter of each queue has waited; ``tooleffect_store_evicted_keys{store}``
  and ``tooleffect_store_maxmemory_policy_evicting{store}`` (``store``:
  ``journal`` or ``dead_letters``), what ``INFO`` says of evictions (no sample
  when the store does not answer: absent, never 0);
- a "Failure class" row on Flower's task page for failed tool tasks (from
  the ``failure_class`` field the worker adds to ``task-failed``).

One concern a module: :mod:`.app` starts Flower and adds the pages to it;
:mod:`.security` holds the request checks of every state-changing POST
(authentication, cross-origin, ``_xsrf`` token, JSON bodies);
:mod:`.handlers` what every page and API handler shares (blocking calls off
the event loop, a 503 for a store that is away, paging parameters);
:mod:`.dead_letters` and :mod:`.approvals` the two tabs and their APIs;
:mod:`.metrics` the gauges; ``templates/`` the pages' templates.

This package's modules import Flower and tornado (except :mod:`.metrics`),
so nothing imports it but the ``flower`` command and the tests: ``celery -A
app tooleffect dlq list`` loads neither.
"""
