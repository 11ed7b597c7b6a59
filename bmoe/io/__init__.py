"""Adapters to files and memory: GGUF layout, validation, positioned reads, reserved regions."""
