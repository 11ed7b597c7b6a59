"""``python -m bmoe.cli``: the command line run as a module (the tests run it so)."""

import sys

from bmoe.cli import main

sys.exit(main())
