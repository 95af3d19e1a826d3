"""The worker: the Celery hooks that run tools (nothing here is public).

``execution`` runs one call of a tool (the protocol ``ToolTask.__call__``
hands over to); ``request`` ends, in the worker's main process, the calls a
pool child could not end itself; ``handoff`` is what passes between the two
processes; ``strategy`` and ``consumer`` refuse bad messages as dead letters;
``heartbeat`` keeps a long write's leases alive; ``retries`` decides retries;
``startup`` and ``signals`` check and observe. ``docs/architecture.md`` lists
every module.
"""
