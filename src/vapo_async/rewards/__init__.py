"""vapo_async.rewards."""
