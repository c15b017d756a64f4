"""Simulated engine pods: the real scheduler with the model forward replaced
by a step-time model (step_profile), fitted from real steps (step_features)."""
