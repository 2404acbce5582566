"""vapo_async: asynchronous VAPO (value-model PPO) for reasoning LLMs.

Packages follow process boundaries: ``learner`` (Lightning, FSDP2), ``generator`` (vLLM),
``controller`` (leases, admission, versions), ``transport`` (ZeroMQ wire format, weights), plus
``algo`` (pure tensor maths), ``rewards``, ``data`` and ``eval``.
"""

__version__ = "0.1.0"
