"""The composition root of the library: Session and SyncSession, RunConfig, prefill strategies,
sampling, stop strings, chat templates, the completion dicts, the lossy levers and replay, wiring
``llama`` (the llama.cpp seam), ``io``, ``pipeline``, ``stages`` and ``metrics`` into a session.
The architecture recipes live in ``bmoe.io.recipes``, the command line in ``bmoe.cli``."""
