"""Model definitions, Hugging Face config parsing and weight loading."""
