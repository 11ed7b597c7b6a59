"""``python -m bmoe``: the same command line as the ``bmoe`` script."""

import sys

from bmoe.cli import main

sys.exit(main())
