"""The OpenAI-compatible HTTP server (``bmoe serve``): an ASGI application on Starlette, served by
uvicorn on uvloop, with the engine on the server's own event loop (no second loop, no thread per
request). ``create_app`` builds the application around an open Session or a model path;
``serve`` runs it. Heavy imports (starlette, uvicorn, pydantic) happen only when the server is used.
"""
