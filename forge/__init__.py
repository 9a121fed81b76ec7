"""Forge: GRPO fine-tuning for HuggingFace causal language models."""

__version__ = "0.2.0"
