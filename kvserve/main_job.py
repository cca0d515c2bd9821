"""`make run`: the main job on the bundled default model.

For now it generates greedily for a small batch and prints the engine's stats; the operator
benchmark replaces it with a baseline-vs-optimised comparison.
"""

from __future__ import annotations

import sys

from kvserve.cli import main

if __name__ == "__main__":
    sys.exit(
        main(
            [
                "generate",
                "--prompt", "The pass code for",
                "--prompt", "Question: what does the KV cache hold?",
                "--max-tokens", "48",
            ]
        )
    )  # fmt: skip
