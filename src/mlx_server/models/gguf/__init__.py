"""GGUF files: read the tensor table, convert the config, tokenizer and weights, and import
once into an MLX model directory (cached by content hash)."""
