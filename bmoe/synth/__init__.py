"""Synthetic GGUF models written with gguf-py, for tests, demos and measurements."""
