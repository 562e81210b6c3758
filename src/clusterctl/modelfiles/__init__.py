"""modelfiles."""
