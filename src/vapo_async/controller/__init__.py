"""vapo_async.controller: prompts, policy versions and admission control beside learner rank 0.

- ``server``: ``Controller`` (the learner-facing API and the controller thread);
  ``handlers``: its per-message logic.
- ``leases``: ``Ledger``, every admitted prompt from lease to trained, exactly once.
- ``admission``: the eta staleness rule; ``order``: seeded per-epoch prompt order.
- ``stats``: rejection counters and rate-limited logs; ``config``: ``ControllerConfig``.
"""
