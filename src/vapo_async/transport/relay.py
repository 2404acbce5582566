"""The weight relay between generators: each byte of a version leaves the learner once.

A generator that fetches a version (it cannot read the learner's directory) tells the controller
where it serves the bytes it has (``relay_join``); the controller names the generator that asked
before it for the same version, or none (``relay_peer``; ``controller/relay.py``): a chain in
the order of asking. The generator then fetches the small MANIFEST.json from the controller and
every other file from that peer, falling back to the controller (the repair path) for the rest
of the version when the peer refuses, sends nothing new for ``relay.stall_s``, or sends bytes
that do not match the manifest's digest (``transport/fetch.py``).

``RelayServer`` (one thread per generator, started at its first fetch) answers ``fetch`` from
the weights cache, for the versions its own fetches registered (``serve``: the file sizes of a
manifest that matched the announcement): the finished ``v{version:08d}/`` or the one still being
fetched, ``.part-v{version:08d}/``, whose files are valid prefixes (fetch.py appends in order).
A request for bytes not there yet is held until they are, so the chain is pipelined (a peer
forwards a chunk as soon as it landed), or until ``stall_s`` passes (``fetch_stalled``). Bytes
are not verified here: every receiver checks each file against its own manifest.

Security: the server uses CURVE exactly when the generator's link to the controller does, with
the generator's own key pair as server key (its public key travels in ``relay_join``, so only
generators the controller talks to learn it). When the generator also has
``curve.authorized_keys_dir``, clients are checked against it (ZAP, on the server's own context);
otherwise any client that knows the server key is served. Without CURVE the same rule as for the
controller applies: loopback only, unless ``allow_insecure``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from vapo_async.transport.config import TransportConfig
from vapo_async.transport.messages import (
    Chunk,
    ErrorReply,
    Fetch,
    MessageError,
    decode_fetch,
    decode_from_controller,
)
from vapo_async.transport.sockets import (
    AuthorizedKeys,
    InsecureEndpointError,
    endpoint_host,
    is_local_endpoint,
    tune_socket,
    use_curve,
)
from vapo_async.transport.weights import version_dir_name

log = logging.getLogger(__name__)

_MAX_PENDING = 4096
"""Requests held at once (a few windows per downstream peer); beyond it they are refused."""
_KEEP_VERSIONS = 4
"""Registered versions remembered (older ones are pruned from the cache by the generator anyway)."""


def advertised_host(cfg: TransportConfig) -> str:
    """The address other generators reach this one at: ``relay.host``, or the local address of the
    route to the controller (no packet is sent: a UDP socket is only connected)."""
    if cfg.relay.host:
        return cfg.relay.host
    if is_local_endpoint(cfg.endpoint):
        return "127.0.0.1"
    host, port = endpoint_host(cfg.endpoint), int(cfg.endpoint.rpartition(":")[2])
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class RelayServer:
    """Serves registered weight versions of ``cache_dir`` to other generators (module docstring)."""

    def __init__(self, cfg: TransportConfig, cache_dir: Path) -> None:
        self.cfg = cfg
        self.cache_dir = Path(cache_dir)
        self.counts: Counter[str] = Counter()
        """served_bytes, served_chunks, refused/<reason>, rejected/<reason>, dropped (peer gone)."""
        self.error: BaseException | None = None
        """What stopped the server thread, if anything did (``check`` raises it)."""
        self._sizes: dict[int, dict[str, int] | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._router = self._ctx.socket(zmq.ROUTER)
        try:
            self.public_key = self._setup(advertised_host(cfg))
        except BaseException:
            self._teardown()
            raise
        self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="relay-server", daemon=True)
        self._thread.start()
        log.info("weight relay server at %s serving %s", self.address, self.cache_dir)

    def _setup(self, host: str) -> str:
        """Bind the ROUTER (CURVE when the controller link uses it); returns the z85 public key or ''."""
        endpoint = _tcp(host, self.cfg.relay.port)
        curve = use_curve(self.cfg, [self.cfg.endpoint, endpoint], "client")
        tune_socket(self._router, self.cfg)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        public = b""
        if curve:
            public, secret = zmq.auth.load_certificate(str(self.cfg.curve.client_secret_file))
            if secret is None:
                raise ValueError(f"{self.cfg.curve.client_secret_file} holds no secret key")
            if self.cfg.curve.authorized_keys_dir:
                self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(__name__ + ".zap"))
                self._auth.start()
                self._auth.configure_curve_callback(
                    domain="*", credentials_provider=AuthorizedKeys(self.cfg.curve.authorized_keys_dir))
            self._router.curve_publickey = public
            self._router.curve_secretkey = secret
            self._router.curve_server = True
        self._router.bind(endpoint)
        return public.decode()

    # ---- the fetching thread's side ----

    def expect(self, version: int) -> None:
        """``version`` is about to be fetched here: hold requests for it until ``serve`` or ``forget``."""
        self._register(version, None)

    def serve(self, version: int, sizes: dict[str, int]) -> None:
        """Offer ``version`` (file name -> size, from a manifest that matched its announcement)."""
        self._register(version, dict(sizes))

    def forget(self, version: int) -> None:
        """This generator's fetch of ``version`` failed before its manifest matched: refuse it."""
        with self._lock:
            if self._sizes.get(version, {}) is None:
                del self._sizes[version]

    def _register(self, version: int, sizes: dict[str, int] | None) -> None:
        with self._lock:
            if sizes is not None or self._sizes.get(version) is None:
                self._sizes[version] = sizes
            for old in sorted(self._sizes)[:-_KEEP_VERSIONS]:
                del self._sizes[old]

    def check(self) -> None:
        """Raise what stopped the server thread (a bug: it handles every bad request itself)."""
        if self.error is not None:
            raise RuntimeError(f"weight relay server at {self.address} stopped: {self.error!r}") from self.error

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._teardown()

    def _teardown(self) -> None:
        self._router.close(linger=0)  # after the thread ended (its poll wakes every 200 ms)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ---- the server thread ----

    def _run(self) -> None:
        pending: dict[tuple[bytes, int, str, int], tuple[Fetch, float]] = {}
        try:
            while not self._stop.is_set():
                if self._router.poll(5 if pending else 200):
                    self._receive(pending)
                self._answer_ready(pending, time.monotonic())
        except BaseException as e:  # recorded and re-raised on the fetching thread by check()
            log.exception("weight relay server failed")
            self.error = e

    def _receive(self, pending: dict[tuple[bytes, int, str, int], tuple[Fetch, float]]) -> None:
        """Take every request waiting on the socket into ``pending`` (a repeat replaces its twin)."""
        while True:
            try:
                sender, *frames = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = sender.bytes
            try:
                req = decode_fetch(frames, self.cfg.limits)
            except MessageError as e:
                self.counts[f"rejected/{e.reason}"] += 1
                self._send(ident, ErrorReply(e.reason, str(e)).to_frames())
                continue
            if len(pending) >= _MAX_PENDING:
                self._refuse(ident, "fetch_busy", f"{len(pending)} requests already held")
                continue
            pending[(ident, req.version, req.file, req.offset)] = (req, time.monotonic())

    def _answer_ready(self, pending: dict[tuple[bytes, int, str, int], tuple[Fetch, float]], now: float) -> None:
        for key, (req, since) in list(pending.items()):
            frames = self._answer(req)
            if frames is None and now - since > self.cfg.relay.stall_s:
                frames = self._refusal("fetch_stalled", f"{req.file} of version {req.version} did not reach "
                                       f"{req.offset + req.length} bytes within {self.cfg.relay.stall_s} s")
            if frames is not None:
                del pending[key]
                self._send(key[0], frames)

    def _answer(self, req: Fetch) -> list | None:
        """Frames answering ``req``, or None while its bytes have not landed yet."""
        with self._lock:
            if req.version not in self._sizes:
                return self._refusal("fetch_unknown_version", f"version {req.version} is not served here")
            sizes = self._sizes[req.version]
        if sizes is None:
            return None  # its manifest is on the way
        size = sizes.get(req.file)
        if size is None:
            return self._refusal("fetch_unknown_file", f"{req.file!r} is not served for version {req.version}")
        if req.offset > size:
            return self._refusal("fetch_range", f"offset {req.offset} beyond {req.file} size {size}")
        end = min(size, req.offset + req.length)
        name = version_dir_name(req.version)
        for d in (self.cache_dir / name, self.cache_dir / f".part-{name}"):
            try:
                fd = os.open(d / req.file, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue
            try:
                if os.fstat(fd).st_size < end:
                    return None
                data = os.pread(fd, end - req.offset, req.offset)
            finally:
                os.close(fd)
            self.counts["served_bytes"] += len(data)
            self.counts["served_chunks"] += 1
            return Chunk(req.version, req.file, req.offset, size, data).to_frames()
        if not (self.cache_dir / f".part-{name}").is_dir() and not (self.cache_dir / name).is_dir():
            return self._refusal("fetch_unavailable", f"version {req.version} is no longer held here")
        return None  # the file is not started yet, or was just renamed into place

    def _refusal(self, reason: str, detail: str) -> list:
        self.counts[f"refused/{reason}"] += 1
        return ErrorReply(reason, detail).to_frames()

    def _refuse(self, ident: bytes, reason: str, detail: str) -> None:
        self._send(ident, self._refusal(reason, detail))

    def _send(self, ident: bytes, frames: list) -> None:
        """Never blocks: a reply to a vanished or saturated peer is dropped and counted (the peer
        re-asks, or leaves for the controller)."""
        try:
            self._router.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.counts["dropped"] += 1
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.counts["dropped"] += 1


class PeerLink:
    """A DEALER to another generator's relay server: the ``send``/``recv`` pair fetch.py uses."""

    def __init__(self, cfg: TransportConfig, ctx: zmq.Context, address: str, public_key: str) -> None:
        self.address = address
        self.cfg = cfg
        if not public_key and not is_local_endpoint(address) and not cfg.allow_insecure:
            raise InsecureEndpointError(f"relay peer {address} offers no CURVE key and is not on loopback "
                                        "(transport.allow_insecure=true accepts plain text)")
        self.dealer = ctx.socket(zmq.DEALER)
        try:
            tune_socket(self.dealer, cfg)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.setsockopt(zmq.SNDTIMEO, int(cfg.relay.stall_s * 1000))
            if public_key:
                public, secret = zmq.auth.load_certificate(str(cfg.curve.client_secret_file))
                if secret is None:
                    raise ValueError(f"{cfg.curve.client_secret_file} holds no secret key")
                self.dealer.curve_publickey = public
                self.dealer.curve_secretkey = secret
                self.dealer.curve_serverkey = public_key.encode()
            self.dealer.connect(address)
        except BaseException:
            self.dealer.close(linger=0)
            raise

    def send(self, frames: list) -> None:
        try:
            self.dealer.send_multipart(frames, copy=False)
        except zmq.Again:  # the peer stopped reading: fetch.py times out and leaves it
            log.debug("relay request to %s dropped: peer not reading", self.address)

    def recv(self, timeout_ms: int) -> Chunk | ErrorReply | None:
        if not self.dealer.poll(timeout_ms):
            return None
        frames = self.dealer.recv_multipart(copy=False)
        try:
            msg = decode_from_controller(frames, self.cfg.limits)
        except MessageError as e:
            return ErrorReply("fetch_bad_reply", f"peer {self.address}: {e}")
        return msg if isinstance(msg, Chunk | ErrorReply) else ErrorReply("fetch_bad_reply", type(msg).__name__)

    def close(self) -> None:
        self.dealer.close(linger=0)
