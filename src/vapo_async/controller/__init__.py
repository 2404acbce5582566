"""vapo_async.controller: prompts, policy versions and admission control beside learner rank 0.

- ``server``: ``Controller``, the learner-facing API and the socket thread around the state machine;
- ``state``: ``ControllerState``, the state machine (events in, replies out; no sockets or clocks);
- ``items``: an admitted prompt's states and checked transitions; ``leases``: ``Ledger``, every
  item and lease from admission to trained, exactly once; ``sessions``: generator sessions and the
  fair split of scarce work;
- ``admission``: the eta staleness rule; ``order``: seeded per-epoch prompt order;
- ``stats``: rejection counters and rate-limited logs; ``config``: ``ControllerConfig``.
"""
