"""statedir."""
