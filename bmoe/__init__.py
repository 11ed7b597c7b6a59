"""bmoe: run Mixture-of-Experts GGUF models bigger than RAM by reading routed experts from disk."""

__version__ = "0.1.0"
