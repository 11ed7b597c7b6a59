"""The pipeline stages: prefetch (plan), read (I/O lanes), bind (residency), compute (decode)."""
