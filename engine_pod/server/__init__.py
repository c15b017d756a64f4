"""The engine pod's process: async engine loop, gRPC service, health, metrics, tracing."""
