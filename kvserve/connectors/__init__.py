"""KV connectors: every movement of KV bytes between pools, tiers and engines
(:mod:`kvserve.connectors.base` is the API). Import the module you need: this package's
``__init__`` imports nothing, so the scheduler can depend on the API alone."""
