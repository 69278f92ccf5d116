"""mlx-server: an OpenAI- and Anthropic-compatible inference server for MLX models."""

__version__ = "0.1.0"
