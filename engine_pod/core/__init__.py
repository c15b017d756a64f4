"""Scheduling and KV cache management: the block pool, the KV cache manager,
the scheduler and what it exchanges with the runner (the engine loop that
drives them is engine/engine_core.py)."""
