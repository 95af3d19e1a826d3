"""The root conftest of Celery's integration suite as run by ``run.py``.

Copied next to the suite's ``t/``: it registers Celery's pytest plugin (the
suite's own conftest imports only some of its fixtures) and, when
``SUITE_TASK_CLS`` is set, gives the suite's app that ``task_cls``: every
task of ``t/integration/tasks.py`` (``@shared_task``) then has it as its base.
"""

import os

import pytest

pytest_plugins = ["celery.contrib.pytest"]


@pytest.fixture(scope="session")
def celery_parameters() -> dict[str, str]:
    task_cls = os.environ.get("SUITE_TASK_CLS")
    return {"task_cls": task_cls} if task_cls else {}
