"""Tessera: platform-wide tooling (CLI, text processing, fixtures, benchmarks)."""
