"""Weights: move trained weights from the trainer to the rollout engines."""
