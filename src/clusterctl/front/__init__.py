"""front."""
