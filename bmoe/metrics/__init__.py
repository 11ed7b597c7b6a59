"""Per-run and per-token measurements."""
