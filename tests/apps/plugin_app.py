"""A user's app, as the pytest plugin's tests see it: three tools, one per
effect, without deadlines, configured for nothing in particular (the plugin
points it at the test's Redis)."""

from __future__ import annotations

from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask

app = Celery("plugin_app", broker="redis://127.0.0.1:1/0")
app.conf.task_default_queue = "user-tools"


@app.task(base=ToolTask, name="user.lookup")
def lookup(key: str) -> str:
    return key


@app.task(base=ToolTask, name="user.save", effect=ToolEffect.IDEMPOTENT_WRITE)
def save(key: str) -> str:
    return key


@app.task(base=ToolTask, name="user.send", effect=ToolEffect.NON_IDEMPOTENT_WRITE)
def send(key: str) -> str:
    return key
