"""The paged KV cache: block pool, manager, block hashing and storage formats."""
