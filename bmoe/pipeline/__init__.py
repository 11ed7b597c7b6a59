"""Routing events, readiness, stage wiring and cache policy: pure, no native dependencies."""
