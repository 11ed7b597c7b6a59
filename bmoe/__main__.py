"""``python -m bmoe`` runs the command line, as the installed ``bmoe`` script does (same ``main``),
for a checkout used without installing its entry point."""

import sys

from bmoe.cli import main

sys.exit(main())
