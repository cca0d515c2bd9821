"""The simulator: the engine's own scheduler and KV manager, with a cost model in place of the
forward pass and a virtual clock in place of time (``kvserve simulate``), and the search over
configurations built on it (``kvserve tune``)."""
