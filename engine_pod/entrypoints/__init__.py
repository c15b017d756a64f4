"""User-facing entry points of the engine."""
