"""Socket set-up for both ends: endpoint classification, CURVE authentication, high-water marks.

Security rule: an endpoint is *local* when it is ``ipc://`` or ``tcp://`` on a loopback address
(127.0.0.0/8, ::1, localhost). Local endpoints work without keys. Any other endpoint needs CURVE
keys (``TransportConfig.curve``) on both sides; without them binding/connecting raises
``InsecureEndpointError`` unless ``allow_insecure=True``, which logs a loud warning. With keys
configured (or ``curve.force``) CURVE is used on every endpoint, loopback included. The controller
authenticates generators with ``zmq.auth.thread.ThreadAuthenticator`` against a directory of
authorised public keys (ZAP), on its own ``zmq.Context`` so no other socket of the process is
affected.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from vapo_async.transport.config import CurveConfig, TransportConfig

log = logging.getLogger(__name__)

_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 5000


class InsecureEndpointError(RuntimeError):
    """Refused to use a non-loopback endpoint without CURVE keys (and without allow_insecure)."""


def endpoint_host(endpoint: str) -> str:
    """Host part of ``tcp://HOST:PORT`` (brackets of IPv6 removed); '' for ipc/inproc."""
    if not endpoint.startswith("tcp://"):
        return ""
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address; False otherwise (incl. '*')."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"unsupported endpoint {endpoint!r} (use tcp://HOST:PORT or ipc://PATH)")
    host = endpoint_host(endpoint)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname, an interface name or '*': treat as reachable from outside
        return False


def use_curve(cfg: TransportConfig, endpoints: list[str], side: str) -> bool:
    """Decide whether ``side`` ('server'/'client') uses CURVE on ``endpoints``; raise if unsafe."""
    ready = cfg.curve.server_ready() if side == "server" else cfg.curve.client_ready()
    if ready:
        return True
    if cfg.curve.force:
        raise InsecureEndpointError(f"transport.curve.force is set but the {side} key files are not configured")
    remote = [e for e in endpoints if not is_local_endpoint(e)]
    if not remote:
        return False
    if not cfg.allow_insecure:
        if side == "server":  # only the learner binds: its transport sits under controller.
            keys = ("controller.transport.curve.server_secret_file and "
                    "controller.transport.curve.authorized_keys_dir")
            insecure = "controller.transport.allow_insecure=true"
        else:
            keys = "transport.curve.server_public_file and transport.curve.client_secret_file"
            insecure = "transport.allow_insecure=true"
        raise InsecureEndpointError(
            f"refusing to {'bind' if side == 'server' else 'connect'} {remote} without CURVE keys: set {keys} "
            f"(python -m vapo_async.transport.keys DIR makes them and prints the overrides), or {insecure} "
            "to accept unauthenticated plain-text traffic"
        )
    log.warning("!!! INSECURE: %s %s without CURVE authentication or encryption "
                "(transport.allow_insecure=true); anyone who can reach it can inject rollouts !!!",
                side, remote)
    return False


def _load_pair(path: str | None, what: str) -> tuple[bytes, bytes | None]:
    if not path or not Path(path).is_file():
        raise FileNotFoundError(f"CURVE {what} key file not found: {path!r}")
    public, secret = zmq.auth.load_certificate(path)
    return public, secret


def tune_socket(sock: zmq.Socket, cfg: TransportConfig) -> None:
    """High-water marks, ZMTP heartbeats and the message size cap every socket of the transport uses."""
    sock.setsockopt(zmq.SNDHWM, cfg.sndhwm)
    sock.setsockopt(zmq.RCVHWM, cfg.rcvhwm)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
    # A peer sending a frame over twice the validation limit is disconnected by ZeroMQ itself;
    # frames between 1x and 2x reach the validator and are counted as frame_too_large.
    biggest = max(cfg.limits.max_frame_bytes, cfg.limits.max_header_bytes, cfg.limits.max_chunk_bytes)
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * biggest)


def _server_curve(sock: zmq.Socket, curve: CurveConfig) -> None:
    public, secret = _load_pair(curve.server_secret_file, "server secret")
    if secret is None:
        raise ValueError(f"{curve.server_secret_file} holds no secret key")
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def _client_curve(sock: zmq.Socket, curve: CurveConfig) -> None:
    public, secret = _load_pair(curve.client_secret_file, "client secret")
    if secret is None:
        raise ValueError(f"{curve.client_secret_file} holds no secret key")
    server_public, _ = _load_pair(curve.server_public_file, "server public")
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public


class AuthorizedKeys:
    """CURVE credentials of the controller: the public keys (``*.key``) in ``directory``, re-read
    whenever the directory changes, so a generator host whose key is copied in later is admitted
    without restarting the learner (and a removed key is refused from its next connection)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._stamp: tuple[tuple[str, int], ...] | None = None
        self._keys: frozenset[bytes] = frozenset()

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP hook (``ThreadAuthenticator.configure_curve_callback``): is ``key`` (z85) admitted?
        Runs once per connection, so listing the directory each time costs nothing that matters."""
        with os.scandir(self.directory) as entries:
            stamp = tuple(sorted((e.name, e.stat().st_mtime_ns) for e in entries))
        if stamp != self._stamp:
            self._keys = frozenset(zmq.auth.load_certificates(str(self.directory)))
            self._stamp = stamp
        return key in self._keys


class ServerSockets:
    """The controller's ROUTER (requests, rollouts, fetches) and PUB (weight announcements).

    Back-pressure, end to end:
    1. Credit: a generator only samples prompts it was leased, and the controller leases only
       what admission allows (at most (eta + 1) * B groups admitted beyond those trained), so the
       rollouts in flight plus those buffered at the controller are bounded by admission, not by
       generator speed. A slow learner stops leases; generators idle instead of growing memory.
    2. High-water marks: ``rcvhwm`` messages per generator are queued in the ROUTER; beyond it
       ZeroMQ stops reading that TCP connection, so the sender's DEALER queue fills and its
       blocking ``send`` waits (at most ``send_timeout_ms``). ``MAXMSGSIZE`` drops peers that send
       frames over twice the size limit.
    3. The controller never blocks on a generator: ROUTER sends are non-blocking with
       ``ROUTER_MANDATORY``; a reply to a vanished or saturated peer is dropped and counted (the
       lease deadline then re-issues whatever it carried). PUB drops for slow subscribers by
       design; the controller re-sends the latest announcement every few seconds and every lease
       repeats it, so none is lost for good.
    """

    def __init__(self, cfg: TransportConfig, ctx: zmq.Context) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.curve = use_curve(cfg, [cfg.endpoint, cfg.resolved_pub_endpoint()], "server")
        self.auth: ThreadAuthenticator | None = None
        if self.curve:
            _load_pair(cfg.curve.server_secret_file, "server secret")  # fail before creating anything
            if not Path(str(cfg.curve.authorized_keys_dir)).is_dir():
                raise FileNotFoundError(f"CURVE authorized_keys_dir not found: {cfg.curve.authorized_keys_dir!r}")
        self.router = ctx.socket(zmq.ROUTER)
        self.pub = ctx.socket(zmq.PUB)
        try:
            self._setup(cfg)
        except BaseException:
            self.close()
            raise
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pub_endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def _setup(self, cfg: TransportConfig) -> None:
        if self.curve:
            self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger(__name__ + ".zap"))
            self.auth.start()
            self.auth.configure_curve_callback(domain="*",
                                               credentials_provider=AuthorizedKeys(str(cfg.curve.authorized_keys_dir)))
        for sock in (self.router, self.pub):
            tune_socket(sock, cfg)
            sock.setsockopt(zmq.LINGER, 0)
            if self.curve:
                _server_curve(sock, cfg.curve)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.bind(cfg.endpoint)
        self.pub.bind(cfg.resolved_pub_endpoint())

    def close(self) -> None:
        """Close both sockets and stop the authenticator."""
        self.router.close(linger=0)
        self.pub.close(linger=0)
        if self.auth is not None:
            self.auth.stop()


class ClientSockets:
    """A generator's DEALER (to the controller ROUTER) and SUB (weight announcements).

    The DEALER's routing id is ``generator_id:session`` so a reconnect after a network blip keeps
    its identity (the ROUTER uses ``ROUTER_HANDOVER``). Sends block at most ``send_timeout_ms`` when
    the high-water mark is reached (see ``ServerSockets`` for the whole back-pressure story). The SUB
    keeps only the newest announcement (``CONFLATE``): older versions are useless once a newer exists.
    """

    def __init__(self, cfg: TransportConfig, ctx: zmq.Context, routing_id: str) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.curve = use_curve(cfg, [cfg.endpoint], "client")
        if self.curve:  # fail on missing key files before creating any socket
            _load_pair(cfg.curve.client_secret_file, "client secret")
            _load_pair(cfg.curve.server_public_file, "server public")
        self.dealer = ctx.socket(zmq.DEALER)
        tune_socket(self.dealer, cfg)
        self.dealer.setsockopt(zmq.ROUTING_ID, routing_id.encode())
        self.dealer.setsockopt(zmq.SNDTIMEO, cfg.send_timeout_ms)
        self.dealer.setsockopt(zmq.LINGER, 1000)
        if self.curve:
            _client_curve(self.dealer, cfg.curve)
        self.dealer.connect(cfg.endpoint)
        self.sub: zmq.Socket | None = None

    def connect_sub(self, pub_endpoint: str) -> zmq.Socket:
        """(Re)connect the SUB socket to ``pub_endpoint`` (wildcard hosts replaced by ours)."""
        host = endpoint_host(pub_endpoint)
        if host in ("*", "0.0.0.0", "::") and self.cfg.endpoint.startswith("tcp://"):
            port = pub_endpoint.rpartition(":")[2]
            pub_endpoint = f"tcp://{endpoint_host(self.cfg.endpoint)}:{port}"
        use_curve(self.cfg, [pub_endpoint], "client")  # same security rule for the PUB address
        if self.sub is not None:
            self.sub.close(linger=0)
        sub = self.ctx.socket(zmq.SUB)
        tune_socket(sub, self.cfg)
        sub.setsockopt(zmq.CONFLATE, 1)
        sub.setsockopt(zmq.LINGER, 0)
        if self.curve:
            _client_curve(sub, self.cfg.curve)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub_endpoint)
        self.sub = sub
        return sub

    def close(self, linger_ms: int = 1000) -> None:
        """Close both sockets, letting queued messages out for up to ``linger_ms``."""
        self.dealer.close(linger=linger_ms)
        if self.sub is not None:
            self.sub.close(linger=0)
