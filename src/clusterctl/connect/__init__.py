"""connect."""
