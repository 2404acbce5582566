"""The learner's configuration error: what ``python -m vapo_async.learner`` prints as one line
(``vapo_async.learner: error: ...``) before exiting with code 2."""


class ConfigError(ValueError):
    """An invalid setting; the message names the key."""
