"""vapo_async.generator: vLLM generator processes (``python -m vapo_async.generator``).

- ``engine``: the vLLM wrapper (``Engine`` Protocol, ``VLLMEngine``): groups with per-token
  behaviour log-probs and exact per-token policy versions; in-place reloads between steps.
- ``sync``: the weight subscriber (verify or fetch, then reload; refuses bad files).
- ``loop``: leases -> requests -> scored groups (one-prompt ``RolloutBatch``) messages.
"""
