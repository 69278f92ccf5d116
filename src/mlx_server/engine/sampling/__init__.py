"""Samplers, logits processors and log-probabilities."""
