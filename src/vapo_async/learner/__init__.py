"""vapo_async.learner."""
