"""Typed configuration of a generator process (``python -m vapo_async.generator``).

Registered in Hydra's ConfigStore by ``register_configs()`` so that a typo in an override is an
error. Sampling settings can also come from the controller's ``welcome`` (``sampling`` map: ``n``,
``temperature``, ``top_p``, ``max_tokens``); those override this file, so that every generator
samples the way the learner expects.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from vapo_async.common.engine import EngineConfig
from vapo_async.common.sampling import GroupSamplingConfig
from vapo_async.rewards import RewardConfig
from vapo_async.transport.config import TransportConfig

log = logging.getLogger("vapo_async.generator")

_MAX_IPC_PATH_BYTES = 107
"""Longest ``ipc://`` path the kernel accepts (``sun_path`` holds 108 bytes with the NUL)."""


def check_endpoint(key: str, endpoint: str) -> None:
    """Raise ``ValueError`` naming ``key`` unless ``endpoint`` is ``tcp://HOST:PORT`` (port
    1-65535, a concrete host) or ``ipc://PATH`` (short enough for a Unix socket). Syntax only:
    nothing is contacted, so a generator may still start before its controller."""
    problem = ""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path:
            problem = "empty ipc path"
        elif len(path.encode()) > _MAX_IPC_PATH_BYTES:
            problem = f"ipc path longer than {_MAX_IPC_PATH_BYTES} bytes"
    elif endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if not sep or not host or host == "*":
            problem = "needs a host and a port"
        elif not port.isdigit() or not 0 < int(port) < 65536:
            problem = f"port {port!r} is not in 1-65535"
    else:
        problem = "unsupported scheme"
    if problem:
        raise ValueError(f"{key} must be tcp://HOST:PORT or ipc://PATH, got {endpoint!r} ({problem})")


def reward_with_welcome(local: RewardConfig, sent: dict[str, Any]) -> RewardConfig:
    """The learner's reward settings (``welcome.reward``) in place of ``local``, which only fills
    fields the controller did not send. A key this generator does not know, or a value its
    ``RewardConfig`` refuses, is a ``ValueError`` naming it: the generator refuses to start rather
    than score differently from what the learner expects."""
    known = {f.name for f in fields(RewardConfig)}
    unknown = sorted(set(sent) - known)
    if unknown:
        raise ValueError(f"controller sent reward settings this generator does not know: {unknown} "
                         "(a different vapo_async version?)")
    differ = sorted(k for k, v in sent.items() if getattr(local, k) != v)
    if differ:
        log.info("reward settings from the controller replace this generator's: %s", differ)
    try:
        return replace(local, **sent)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward settings from the controller are invalid here: {e}") from None


@dataclass
class GeneratorConfig:
    """A generator process: where the controller is, which model, how to sample and score."""

    controller: str = "tcp://127.0.0.1:5555"
    """Controller ROUTER endpoint (tcp://HOST:PORT or ipc://PATH); copied into transport.endpoint."""
    model: str | None = None
    """Hugging Face directory the engine starts from; None = the weights the controller announces."""
    model_version: int = 0
    """Policy version held by ``model`` (0 = the learner's initial weights)."""
    generator_id: str | None = None
    """Name shown in controller logs; None = ``<hostname>-<pid>``."""
    max_prompts: int = 8
    """Prompts (each G responses) in flight at once: the credit this generator asks for."""
    weights_cache: str = "~/.cache/vapo_async/weights"
    """Where this generator keeps the weights it loads (in a subfolder named by its id, removed on
    exit): hard links to the learner's files when it can read them, else chunked fetches. Must
    not be the learner's weights directory."""
    connect_timeout_s: float | None = None
    """Give up when no controller answers within this many seconds; None = wait forever."""
    stats_interval_s: float = 10.0
    """Log throughput and counters this often."""
    log_level: str = "INFO"
    """Python logging level of this process."""
    sampling: GroupSamplingConfig = field(default_factory=GroupSamplingConfig)
    """Sampling (welcome.sampling from the controller overrides it)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """vLLM engine settings."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function settings (must match what the learner expects)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """Transport settings (CURVE keys, timeouts); ``controller`` overrides its endpoint."""

    def __post_init__(self) -> None:
        """Everything checkable without the engine or the network fails here, at start-up."""
        if self.max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1, got {self.max_prompts}")
        check_endpoint("controller", self.controller)
        if self.transport.pub_endpoint:
            check_endpoint("transport.pub_endpoint", self.transport.pub_endpoint)
        if self.connect_timeout_s is not None and self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0 or null, got {self.connect_timeout_s}")
        if self.stats_interval_s <= 0:
            raise ValueError(f"stats_interval_s must be > 0, got {self.stats_interval_s}")
        if not isinstance(logging.getLevelName(str(self.log_level).upper()), int):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {self.log_level!r}")
        if self.model_version < 0:
            raise ValueError(f"model_version must be >= 0, got {self.model_version}")

    def client_transport(self) -> TransportConfig:
        """``transport`` with ``endpoint = controller``, checked as the client will use it: the
        CURVE rule for off-loopback endpoints and the key files (raises ``ValueError`` /
        ``FileNotFoundError`` naming the key). Cheap: call it before the engine starts."""
        from vapo_async.transport.sockets import InsecureEndpointError, use_curve

        cfg = replace(self.transport, endpoint=self.controller)
        try:
            use_curve(cfg, [cfg.endpoint], "client")
        except InsecureEndpointError as e:
            raise ValueError(f"controller={self.controller}: {e}") from None
        for key in ("server_public_file", "client_secret_file"):
            path = getattr(cfg.curve, key)
            if path and not Path(path).expanduser().is_file():
                raise FileNotFoundError(f"transport.curve.{key}: key file {path!r} not found")
        return cfg

    def resolved_id(self) -> str:
        """``generator_id`` or ``<hostname>-<pid>`` (':' is not allowed on the wire)."""
        return (self.generator_id or f"{socket.gethostname()}-{os.getpid()}").replace(":", "-")[:64]


def register_configs() -> None:
    """Register ``GeneratorConfig`` as ``generator_schema`` and ``conf/generator.yaml`` as
    ``generator`` in Hydra's ConfigStore. The generator runs with ``config_path=None``: the
    learner's config groups in ``conf/`` (``model/``, ``algo/``, ...) are then not in its search
    path, so ``model=DIR`` sets the field instead of selecting a ``model`` preset."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    cs.store(name="generator_schema", node=GeneratorConfig)
    cs.store(name="generator", node=OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "generator.yaml"))
