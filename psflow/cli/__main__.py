"""``python -m psflow.cli``: the ``psflow`` command."""

import sys

from psflow.cli import main

sys.exit(main())
