"""vapo_async.algo."""
