"""clusterctl: serve one LLM across several machines with MLX distributed ranks."""

__version__ = "0.1.0"
