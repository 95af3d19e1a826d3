"""What operators use: dead letters, approvals and audit trails.

``operations`` holds every action on dead letters (list, show, replay, purge,
reconcile) once, ``approvals`` every decision on parked calls, ``filters``
the choices a listing is filtered by (from the enums); the ``cli`` and the
``flower`` extension are two front ends to them, with the same JSON.
"""
