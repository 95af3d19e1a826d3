"""``python -m celery_tooleffect.admin.cli -A app ...``: the console script."""

from . import main

main()
