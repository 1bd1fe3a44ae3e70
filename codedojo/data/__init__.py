"""Corpora to training batches: readers, dedup, tokenization, per-token vectors stored beside
the tokens, packing with document masks, mixtures, and SFT rendering with loss masks."""
