"""Simulated vLLM-compatible engines: the OpenAI API, a prefix-caching KV block pool, vLLM's KV-event
stream and a timing model, so the gateway can be run, tested and benchmarked without a GPU."""
