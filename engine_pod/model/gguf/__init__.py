"""GGUF files (llama.cpp's format) as Hugging Face checkpoints: read with the `gguf` package,
dequantized, and written as a folder the engine and transformers both load."""
