"""The actions both the worker and the operators take on a call held back:
deciding and expiring approvals (:mod:`.approving`), publishing a kept
message again (:mod:`.republish`), and asking a tool's reconciler whether an
interrupted write took effect (:mod:`.reconciling`).

A layer below ``worker/`` and above ``store/``: the worker's sweep and
execution call these, and so do ``admin/``'s commands and Flower, which never
import ``worker/``. Nothing here hooks into Celery's worker.
"""
