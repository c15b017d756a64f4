"""Sampling from logits on the logits' device."""
