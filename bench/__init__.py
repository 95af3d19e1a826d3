"""Benchmarks: what the package's safety costs, measured beside plain Celery.

``python -m bench`` runs them all (see ``bench/README.md``). They are not
tests: the test suite only runs ``python -m bench --smoke`` to check that the
program works.
"""
