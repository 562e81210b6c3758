"""supervise."""
