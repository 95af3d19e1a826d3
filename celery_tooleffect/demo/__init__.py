"""The demo, ``python -m celery_tooleffect.demo``: six agent tools on real
workers, their audit trails, an approval, a dead letter, a reconciled charge.

- :mod:`.tutorial`: the script (``__main__`` runs it);
- :mod:`.tools`: the tools, shared with ``examples/agent_app.py``;
- :mod:`.launch`: the demo's app builder, its ``redis-server``\\ s, its
  ``celery worker`` subprocesses and the commands it prints;
- :mod:`.worker_app`: ``celery -A celery_tooleffect.demo.worker_app``, the
  demo's app built from the environment the demo gives its other processes.

Importing this package imports none of them.
"""
