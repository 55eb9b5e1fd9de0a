"""Alembic migrations of the graphdeck store; ``env.py`` takes ``target_metadata`` from
:mod:`graphdeck.store.schema`. Run them through :mod:`graphdeck.store.migrate` (no ``alembic.ini``)."""
