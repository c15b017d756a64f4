"""The OpenAI Batch API: files, batches and the runner that fills idle capacity with them (docs/batch.md)."""
