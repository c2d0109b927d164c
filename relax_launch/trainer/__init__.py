"""Trainer: the Megatron-core policy model and its train step."""
