"""OpenAI-compatible HTTP server (``kvserve serve``).

Kept import-light on purpose: ``kvserve.cli`` imports :mod:`kvserve.server.command` to register
the subcommand, and building the parser must not pull in FastAPI or torch.

Modules: ``args`` (the serve flags), ``command`` (the CLI's parser and handler), ``protocol``
(pydantic request models, OpenAI errors), ``request_fields`` (the fields refused, and unknown
ones logged and counted), ``engine_loop`` (the one thread that owns the engine), ``serving``
(completions / chat: prompts in, SSE or JSON out), ``job`` (a request's response shape),
``logprobs`` (log-prob formats), ``chat_prompt`` (the chat template), ``tokenize``
(/tokenize, /detokenize), ``tenants`` (API keys and cache salts), ``metrics`` (Prometheus),
``app`` (FastAPI routes, uvicorn runner).
"""
