"""gguf."""
