"""vapo_async.data."""
