"""vapo_async.transport."""
