"""Model code: the Llama-family network, paged attention, loading, tokenizer, sampler."""
