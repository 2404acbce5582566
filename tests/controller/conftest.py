"""Fixtures for controller tests: a started controller on ipc, scripted generators on threads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ctl_helpers import VOCAB, GeneratorThread, prompts

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.server import Controller
from vapo_async.transport.config import TransportConfig
from vapo_async.transport.synthetic import ScriptedGenerator


@pytest.fixture()
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/ctl"


@pytest.fixture()
def make_controller(endpoint: str) -> Iterator[Callable[..., Controller]]:
    """Factory of started controllers on ``endpoint``; all are stopped at teardown."""
    made: list[Controller] = []

    def make(n_prompts: int = 64, batch_groups: int = 4, eta: int = 1, start: bool = True,
             state: dict | None = None, **cfg: object) -> Controller:
        cfg.setdefault("lease_timeout_s", 2.0)
        ccfg = ControllerConfig(transport=TransportConfig(endpoint=endpoint), **cfg)  # type: ignore[arg-type]
        ctl = Controller(ccfg, prompts(n_prompts), batch_groups=batch_groups, eta=eta, vocab_size=VOCAB)
        if state is not None:
            ctl.load_state_dict(state)
        if start:
            ctl.start()
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        ctl.stop()


@pytest.fixture()
def start_generator(endpoint: str) -> Iterator[Callable[..., GeneratorThread]]:
    started: list[GeneratorThread] = []

    def start(generator_id: str, **kw: object) -> GeneratorThread:
        g = GeneratorThread(ScriptedGenerator(TransportConfig(endpoint=endpoint), generator_id, **kw))  # type: ignore[arg-type]
        started.append(g)
        return g

    yield start
    for g in started:
        if g.thread.is_alive() or not g.gen.client._sockets.dealer.closed:
            g.stop()


@pytest.fixture(autouse=True)
def _close_raw_generators() -> Iterator[None]:
    """Close every ``test_server.RawGenerator`` a test left open (e.g. after a failed assert)."""
    yield
    import test_server

    while test_server.RawGenerator.live:
        test_server.RawGenerator.live.pop().close()
