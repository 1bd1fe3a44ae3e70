"""Generation: batched decoding with a KV cache, sampling, speculative decoding with MTP drafts,
and the OpenAI-compatible HTTP server. Works on token ids; the server owns text <-> tokens."""
