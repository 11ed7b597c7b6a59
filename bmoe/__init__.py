"""bmoe: run Mixture-of-Experts GGUF models bigger than RAM by reading routed experts from disk."""

from bmoe._version import __version__

__all__ = ["__version__"]
