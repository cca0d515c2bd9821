"""Quality gate: long-context recall, perplexity and agreement against the exact baseline."""
