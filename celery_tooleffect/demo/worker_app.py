# mypy: disallow-untyped-decorators=False
"""The demo's app for the processes it does not run itself:
``celery -A celery_tooleffect.demo.worker_app`` (act 6's workers, act 4's CLI
command, the commands ``python -m celery_tooleffect.demo --keep`` prints).

Importing this module builds the app (:func:`~celery_tooleffect.demo.launch.build_app`)
from the variables ``TOOLEFFECT_DEMO_BROKER``, ``TOOLEFFECT_DEMO_STORE`` and
``TOOLEFFECT_DEMO_PREFIX``, which the demo sets for those processes (and
``--keep`` prints as ``export`` lines); it raises ``RuntimeError`` when one is
unset. It registers the demo's tools but ``refund_payment`` (which breaks
the store on purpose, in the demo's own process only).
"""

from __future__ import annotations

from .launch import app_from_environment
from .tools import register_email_customers, register_tools

app = app_from_environment()
register_tools(app)
register_email_customers(app)
