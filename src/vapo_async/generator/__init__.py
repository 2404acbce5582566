"""vapo_async.generator."""
