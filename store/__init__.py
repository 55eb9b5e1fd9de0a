"""The graphdeck store: one SQLAlchemy schema over SQLite (the embedded default)."""
