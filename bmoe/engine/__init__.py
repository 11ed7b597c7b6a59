"""The composition root of the library: Session and SyncSession, RunConfig, the llama.cpp seam
(model, context, tokens), the eval callback and its node filter, the loaders (open modes, warm-up
capture), prefill strategies, sampling, stop strings, chat templates, the completion dicts, the
lossy levers and replay, wiring ``io``, ``pipeline``, ``stages`` and ``metrics`` into a session.
The architecture recipes live in ``bmoe.io.recipes``, the command line in ``bmoe.cli``."""
