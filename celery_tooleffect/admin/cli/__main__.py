"""``python -m celery_tooleffect.admin.cli -A app ...``: the console script."""

from . import main

if __name__ == "__main__":
    main()
