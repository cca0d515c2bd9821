"""``kvserve plan``: the KV formula applied to any ``config.json`` and accelerator.

capacity.py reads the architecture facts and applies the engine's own KV accounting; gpus.py is
the accelerator table with its sources; cost.py turns bytes into a decode roofline and dollars;
cli.py prints it and checks it against the live engine (``--validate``).
"""
