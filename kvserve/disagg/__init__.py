"""Disaggregated prefill and decode: a connector that hands a prefill engine's KV blocks to a
decode engine (:mod:`kvserve.disagg.connector`), its wire format and transport, and the proxy
that drives a pair of engines with vLLM's ``kv_transfer_params`` protocol."""

# How kvserve proxy picks an engine of each role.
PROXY_POLICIES = ("round_robin", "least_loaded")
