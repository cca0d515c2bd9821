"""Attention backends apart from KV formats: the step's attention metadata, the torch reference
backend and the CPU kernels' backend, retention's attention paths, and the registry that picks
one by name or device (``--attention-backend``)."""
