"""``python -m kvtier.cli``: the ``kvtier`` command without its console script."""

import sys

from kvtier.cli.main import main

sys.exit(main())
