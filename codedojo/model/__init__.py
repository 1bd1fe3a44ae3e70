"""The model core: decoder (dense and MoE), RoPE + YaRN, GQA attention, KV cache, MTP modules,
weight import/export (GGUF, HF safetensors), tokenizer and chat template. Imports nothing above it."""
