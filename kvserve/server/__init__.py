"""OpenAI-compatible HTTP server (``kvserve serve``).

Kept import-light on purpose: ``kvserve.cli`` imports :mod:`kvserve.server.command` to register
the subcommand, and building the parser must not pull in FastAPI or torch.

Modules: ``args`` (the serve flags), ``command`` (the CLI's parser and handler), ``protocol``
(pydantic request models, OpenAI errors), ``engine_loop`` (the one thread that owns the
engine), ``serving`` (completions / chat responses, SSE), ``tenants`` (API keys and cache
salts), ``metrics`` (Prometheus), ``app`` (FastAPI routes, uvicorn runner).
"""
