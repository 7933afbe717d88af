"""Serving: the paged KV cache, the continuous-batching engine and the OpenAI-compatible server."""
