"""Checkpoint conversion between Hugging Face Llama and megatron ``dist_checkpointing``."""
