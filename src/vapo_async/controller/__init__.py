"""vapo_async.controller."""
