"""Trace replay and the bundled executor (later issues); nothing here yet."""
