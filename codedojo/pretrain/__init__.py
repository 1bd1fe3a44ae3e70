"""Continued pretraining: one staged loop (bulk, long-context, SFT), checkpoints that resume
exactly, and MTP self-distillation."""
