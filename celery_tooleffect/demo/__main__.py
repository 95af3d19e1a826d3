"""``python -m celery_tooleffect.demo``: the tutorial (:mod:`.tutorial`)."""

import sys

from .tutorial import main

if __name__ == "__main__":
    sys.exit(main())
