"""Corpora to training batches: readers, dedup, tokenization, packing with document masks,
mixtures, and SFT rendering with loss masks."""
