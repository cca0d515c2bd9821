"""``kvserve router``: an OpenAI-compatible front over replicas of ``kvserve serve``, routing
each request by a policy (``policies``) that may read the replicas' KV events (``index``,
``events``)."""
