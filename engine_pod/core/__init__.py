"""Engine core: requests, block pool, KV cache manager, scheduler, engine loop."""
