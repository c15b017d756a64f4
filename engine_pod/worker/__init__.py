"""The worker side: model runner, per-request state, KV cache tensors."""
