"""The store: everything celery-tooleffect keeps in Redis.

Connections, key names, the Lua scripts (one file per atomic step), the write
journal and its state machine, the audit log, dead letters and broker leases.
It knows no Celery worker and no operator interface: ``lint-imports``
(``.importlinter``) keeps it so.
"""
