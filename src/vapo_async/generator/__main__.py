"""``python -m vapo_async.generator controller=tcp://HOST:PORT [model=DIR] [key=value ...]``

Setup -> run -> cleanup:
1. Say hello to the controller (retrying with backoff until it answers: a generator may start
   before the learner). Its welcome is the learner's contract: sampling (group size, temperature,
   top_p, max_tokens), the context the engine must offer (``max_model_len``: the learner's longest
   prompt + max_tokens) and the reward settings, which replace this process's own. A generator
   that cannot honour it (``engine.max_model_len`` set shorter, a custom reward it cannot import)
   refuses here with one line. Then build the engine from ``model`` (if given), or from the
   weights the welcome announces (version 0, the base, is announced when the learner starts),
   fetched over ZeroMQ into ``weights_cache`` when the announced path is not readable here.
2. Serve leases (``GeneratorLoop``) until SIGTERM/SIGINT.
3. Hand unfinished leases back (``bye``), shut the engine down, exit 0.

Every process the generator starts dies with it, even on SIGKILL (``common/orphans.py``).

Configuration errors (missing model, bad values, unreachable controller with ``connect_timeout_s``,
refused initial weights) end with a one-line message and exit code 2.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
import msgspec
from omegaconf import DictConfig, OmegaConf

from vapo_async.common.orphans import arm, die_with_parent_forks
from vapo_async.generator.config import GeneratorConfig, register_configs
from vapo_async.transport.weights import WeightsError

if TYPE_CHECKING:
    from vapo_async.transport.client import ControllerClient
    from vapo_async.transport.messages import WeightAnnouncement, Welcome

log = logging.getLogger("vapo_async.generator")


class StopFlag:
    """Set by SIGTERM/SIGINT; forwards to the loop once there is one."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.on_stop: list[Callable[[], None]] = []

    def __call__(self, signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        self.event.set()
        for fn in self.on_stop:
            fn()


def _connect(client: ControllerClient, cfg: GeneratorConfig, stop: StopFlag) -> Welcome | None:
    """Hello until welcomed, stopped, or ``connect_timeout_s`` passes."""
    deadline = None if cfg.connect_timeout_s is None else time.monotonic() + cfg.connect_timeout_s
    while not stop.event.is_set():
        try:
            return client.connect(timeout_s=1.0)
        except TimeoutError:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no controller answered at {cfg.controller} within "
                                   f"{cfg.connect_timeout_s} s") from None
    return None


def _first_announcement(client: ControllerClient, stop: StopFlag) -> WeightAnnouncement | None:
    """Without ``model=``, wait (heartbeating) until the learner publishes its first weights."""
    from vapo_async.transport.messages import WeightAnnouncement

    log.info("no model= given: waiting for the controller to announce weights")
    while not stop.event.is_set():
        for msg in client.poll(200):
            if isinstance(msg, WeightAnnouncement):
                return msg
    return None


def run(cfg: GeneratorConfig) -> int:
    """The whole generator process; returns its exit code."""
    from vapo_async.generator.config import reward_with_welcome
    from vapo_async.generator.engine import VLLMEngine
    from vapo_async.generator.loop import GeneratorLoop
    from vapo_async.generator.sync import WeightSync
    from vapo_async.rewards import RewardFn, build_reward_fn
    from vapo_async.rewards.reward import load_custom
    from vapo_async.transport.client import ControllerClient

    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    die_with_parent_forks()  # forked children (a fork start method)
    arm()  # spawned children: vLLM's EngineCore and its Worker (see common/orphans.py)
    # every cheap check before the ~20 s engine start (the config's own checks ran at parse time)
    if cfg.model is not None and not (Path(cfg.model) / "config.json").is_file():
        raise FileNotFoundError(f"model={cfg.model} is not a Hugging Face model directory (no config.json)")
    transport = cfg.client_transport()
    if cfg.reward.custom is not None:  # the fallback when a controller sends no reward settings
        load_custom(cfg.reward.custom)
    generator_id = cfg.resolved_id()
    cache = Path(cfg.weights_cache).expanduser() / generator_id
    engine: VLLMEngine | None = None
    client: ControllerClient | None = None
    reward_fn: RewardFn | None = None
    try:
        client = ControllerClient(transport, generator_id, max_prompts=cfg.max_prompts)
        client.version = cfg.model_version if cfg.model is not None else 0
        log.info("connecting to controller at %s as %s (CUDA_VISIBLE_DEVICES=%s, engine.gpu_memory_utilization=%s)",
                 cfg.controller, generator_id, os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
                 cfg.engine.gpu_memory_utilization)
        welcome = _connect(client, cfg, stop)
        if welcome is None:
            client.bye([])
            return 0
        # the learner's contract (welcome): context, reward; sampling is adopted by the loop
        engine_cfg = cfg.engine.for_demand(welcome.max_model_len)
        reward_fn = build_reward_fn(reward_with_welcome(cfg.reward, welcome.reward))  # imports reward.custom
        if cfg.model is not None:
            engine = VLLMEngine(cfg.model, engine_cfg, cfg.model_version)
        else:
            first = welcome.weights or _first_announcement(client, stop)
            if first is None:
                client.bye([])
                return 0
            welcome = msgspec.structs.replace(welcome, version=first.version, weights=first)  # it was published since
            path = client.resolve_weights(first, cache)
            engine = VLLMEngine(path, engine_cfg, first.version)
        client.version = engine.version
        weights = WeightSync(client, engine, cache, base_dir=cfg.model, base_version=cfg.model_version,
                             layout_dir=cfg.model or engine.model_dir)
        loop = GeneratorLoop(client, engine, weights, reward_fn, cfg.sampling, cfg.max_prompts,
                             cfg.stats_interval_s)
        stop.on_stop.append(loop.stop)
        if stop.event.is_set():
            loop.stop()
        log.info("generator %s serving %s (engine version %d, context %d tokens, model %s)", generator_id,
                 cfg.controller, engine.version, engine_cfg.context(), engine.model_dir)
        try:
            loop.run(welcome)
        finally:
            loop.close()
            log.info("final stats: %s", loop.snapshot())
    finally:
        if client is not None:
            client.close()
        if reward_fn is not None:
            reward_fn.close()
        if engine is not None:
            engine.shutdown()
        # the cache holds links to the learner's files (they would outlive its pruning) and
        # fetched copies: nothing in it is needed once the engine is gone
        shutil.rmtree(cache, ignore_errors=True)
    return 0


register_configs()


@hydra.main(config_path=None, config_name="generator", version_base=None)
def main(dcfg: DictConfig) -> None:
    try:
        cfg: GeneratorConfig = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
        logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        code = run(cfg)
    except (ValueError, FileNotFoundError, TimeoutError, WeightsError) as e:
        log.debug("configuration error", exc_info=True)
        print(f"vapo_async.generator: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
