"""vapo_async.transport: the ZeroMQ wire between the controller and the generators, and weights.

- ``wire``: the msgspec header base, constrained field types, ``MessageLimits``, ``MessageError``.
- ``batch``: ``RolloutBatch``, ragged rollouts of N prompts whose fields are declared once in ``FIELDS``.
- ``rollout``: the ``group`` message (a one-prompt batch) and its zero-copy ``encode_group`` / ``decode_group``.
- ``messages``: one Struct per control message (hello, request, lease, ack, ...), decoding with validation.
- ``config``: ``TransportConfig`` / ``CurveConfig``; ``sockets``: socket set-up, CURVE, back-pressure;
  ``keys``: CURVE key files (``python -m vapo_async.transport.keys``).
- ``client``: ``ControllerClient``, the generator's end of the link.
- ``weights``: the versioned safetensors directory layout, its manifest, ``verify_weights_dir``;
  ``publisher``: writing versions (``finish_version``, ``WeightPublisher``); ``safetensors_io``:
  one-pass writer and file layouts; ``digest``: xxh3_128 / sha256; ``fetch``: chunked, resumable download.
- ``synthetic``: random groups and a scripted generator (tests, benchmarks, learner stand-ins);
  ``fuzz``: malformed-message generator.

Nothing here unpickles, evaluates or executes received data (enforced by a test).
"""
