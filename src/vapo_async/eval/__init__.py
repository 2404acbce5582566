"""vapo_async.eval."""
