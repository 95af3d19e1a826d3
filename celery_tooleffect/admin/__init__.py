"""Operations: what an operator does with dead letters and audit trails.

``operations`` holds every action (inspect, replay, purge, reconcile) once;
the ``cli`` and the ``flower`` extension are two front ends to it.
"""
