"""The engine: EngineCore's step loop over the scheduler (core/) and the executor."""
