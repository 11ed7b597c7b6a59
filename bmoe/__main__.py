"""``python -m bmoe``: the same command line as the ``bmoe`` script (for a checkout or a venv whose
scripts folder is not on PATH)."""

import sys

from bmoe.cli import main

sys.exit(main())
