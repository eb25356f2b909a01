"""``python -m astage``: the same as the ``astage`` command."""

import sys

from .cli import main

sys.exit(main())
