"""bmoe's version: a leaf every layer may import (the package root imports the engine)."""

__version__ = "0.1.0"
