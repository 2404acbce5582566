"""Chunked, resumable, verified fetch of a published weight version over the controller ROUTER.

Used by generators that cannot read the announced path (another node, no shared filesystem).
Protocol: ``fetch{version, file, offset, length}`` -> ``chunk{version, file, offset, size} + data``.
Files land in ``dest/.part-v{version:08d}/`` and are appended strictly in order (out-of-order chunks
wait in memory, at most ``fetch_window`` of them), so a partial file is always a valid prefix and a
later attempt resumes from its size. MANIFEST.json comes first and must hash to the announced
checksum; every other file must match the manifest's size and digest, computed as the chunks are
appended (one pass; a resumed file's prefix is hashed once when the attempt starts). Only then is
the directory renamed to ``dest/v{version:08d}`` and checked like a shared-filesystem one (its
layout; the digests were just computed).

With a relay peer (``transport/relay.py``) every file but the manifest is asked of the peer first;
when the peer refuses, stalls (no new byte for ``relay.stall_s``) or its bytes fail the digest, the
rest of the version comes from the controller: a partial file is kept and resumed (its bytes are
checked with the rest), a file that failed its digest is fetched again whole.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from vapo_async.transport.config import TransportConfig
from vapo_async.transport.delta import decode_file, parse_delta
from vapo_async.transport.digest import BLOCK, Hasher, new_hasher
from vapo_async.transport.messages import Chunk, ErrorReply, Fetch, WeightAnnouncement
from vapo_async.transport.weights import (
    DELTA,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    WeightsError,
    parse_manifest,
    verify_weights_dir,
    version_dir_name,
)

log = logging.getLogger(__name__)

Send = Callable[[list], None]
RecvChunk = Callable[[int], Chunk | ErrorReply | None]
Serve = Callable[[int, dict[str, int]], None]


@dataclass
class FetchStats:
    """Where the bytes of this generator's fetches came from."""

    controller_bytes: int = 0
    """Bytes received from the controller (they left the learner)."""
    peer_bytes: int = 0
    """Bytes received from a relay peer."""
    fallbacks: Counter[str] = field(default_factory=Counter)
    """Peers left for the controller, per reason (fetch_stalled, checksum, fetch_unavailable, ...),
    and deltas given up for the whole files (``delta``)."""
    delta_files: int = 0
    """Files rebuilt from a delta against the version held (``transport/delta.py``)."""


@dataclass
class Peer:
    """The relay peer to ask first (``send``/``recv`` of a ``relay.PeerLink``)."""

    send: Send
    recv: RecvChunk
    address: str


def fetch_weights(send: Send, recv: RecvChunk, ann: WeightAnnouncement, dest: Path, cfg: TransportConfig,
                  peer: Peer | None = None, serve: Serve | None = None, stats: FetchStats | None = None) -> Path:
    """Fetch ``ann`` into ``dest/v{version:08d}`` and return the verified directory. ``peer``: ask
    it first for every file but the manifest; ``serve(version, sizes)``: told the file sizes once
    the manifest matched the announcement (the local relay server then offers the files)."""
    stats = stats if stats is not None else FetchStats()
    final = dest / version_dir_name(ann.version)
    if final.is_dir():
        try:
            got = verify_weights_dir(final, dest, ann, cfg.limits)
        except WeightsError as e:
            log.warning("existing %s failed verification (%s): fetching again", final, e)
            shutil.rmtree(final)
        else:
            if serve is not None:
                serve(ann.version, {n: (got / n).stat().st_size for n in ann.files})
            return got
    part = dest / f".part-{version_dir_name(ann.version)}"
    part.mkdir(parents=True, exist_ok=True)
    fetcher = _FileFetcher(send, recv, ann.version, cfg)
    try:
        fetcher.fetch(MANIFEST, part / MANIFEST, None, "sha256")
        files, algo = _manifest(part, ann, cfg)
        if serve is not None:
            serve(ann.version, {n: size for n, (size, _) in files.items()})
        done = _from_deltas(fetcher, ann, dest, part, files, algo, stats) if peer is None else set()
        peer_at = "" if peer is None else peer.address
        relay = None if peer is None else _FileFetcher(peer.send, peer.recv, ann.version,
                                                       replace(cfg, fetch_timeout_s=cfg.relay.stall_s),
                                                       source=f"relay peer {peer.address}")
        for name, (size, digest) in files.items():
            if name in done:
                continue
            if relay is not None and (relay := _from_peer(relay, peer_at, name, part, files, algo, ann, stats)):
                continue
            if fetcher.fetch(name, part / name, size, algo) != digest:
                (part / name).unlink()
                raise WeightsError("checksum", f"fetched {name} of version {ann.version} does not match its {algo}")
    finally:
        stats.controller_bytes += fetcher.received
    for extra in set(os.listdir(part)) - set(files) - {MANIFEST}:
        (part / extra).unlink()
    os.rename(part, final)
    return verify_weights_dir(final, dest, ann, cfg.limits, digests=False)


def _from_deltas(fetcher: _FileFetcher, ann: WeightAnnouncement, dest: Path, part: Path,
                 files: dict[str, tuple[int, str]], algo: str, stats: FetchStats) -> set[str]:
    """The files of ``ann`` rebuilt from its deltas against the version this cache holds (empty
    when it holds another one, or when anything fails: those files are then fetched whole)."""
    base = dest / version_dir_name(ann.delta_base)
    if not ann.delta_checksum or not (base / MANIFEST).is_file():
        return set()
    work = dest / f".delta-{version_dir_name(ann.version)}"
    work.mkdir(exist_ok=True)
    done: set[str] = set()
    try:
        fetcher.fetch(DELTA, work / DELTA, None, "sha256")
        base_v, base_checksum, delta_algo, deltas = parse_delta((work / DELTA).read_bytes(), ann.delta_checksum,
                                                               ann.version)
        if base_v != ann.delta_base or hashlib.sha256((base / MANIFEST).read_bytes()).hexdigest() != base_checksum:
            raise WeightsError("delta", f"the cached version {ann.delta_base} is not the deltas' base")
        for name, (dname, dsize, ddigest) in deltas.items():
            if name not in files:
                raise WeightsError("delta", f"delta of {name!r}, which version {ann.version} does not have")
            if fetcher.fetch(dname, work / dname, dsize, delta_algo) != ddigest:
                raise WeightsError("delta", f"{dname} does not match its digest")
            try:
                if decode_file(work / dname, base / name, part / name, algo) != files[name][1]:
                    raise WeightsError("delta", f"{name} rebuilt from its delta does not match the manifest")
            except BaseException:
                (part / name).unlink(missing_ok=True)  # never a resumable prefix: it is not the file's
                raise
            done.add(name)
    except WeightsError as e:
        stats.fallbacks["delta"] += 1
        log.warning("deltas of version %d against %d given up after %d files (%s): fetching the rest whole",
                    ann.version, ann.delta_base, len(done), e)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stats.delta_files += len(done)
    return done


def _manifest(part: Path, ann: WeightAnnouncement, cfg: TransportConfig) -> tuple[dict[str, tuple[int, str]], str]:
    """The fetched manifest checked against ``ann`` ({name: (bytes, digest)}, hash); a bad one is deleted."""
    if (part / MANIFEST).stat().st_size > MAX_MANIFEST_BYTES:
        (part / MANIFEST).unlink()
        raise WeightsError("manifest", "fetched MANIFEST.json is too large")
    try:
        return parse_manifest((part / MANIFEST).read_bytes(), ann, cfg.limits)
    except WeightsError:
        (part / MANIFEST).unlink()
        raise


def _from_peer(relay: _FileFetcher, peer_at: str, name: str, part: Path, files: dict[str, tuple[int, str]],
               algo: str, ann: WeightAnnouncement, stats: FetchStats) -> _FileFetcher | None:
    """Fetch ``name`` from the peer; returns ``relay`` when the file is complete and matches its
    digest, None when the peer is left for the controller (which then fetches the file's rest)."""
    size, digest = files[name]
    before = relay.received
    try:
        got = relay.fetch(name, part / name, size, algo)
        reason, why = ("", "") if got == digest else ("checksum", f"its bytes do not match the {algo} digest")
    except WeightsError as e:
        reason, why = (relay.refusal if e.reason == "fetch_refused" else e.reason), str(e)
    finally:
        stats.peer_bytes += relay.received - before
    if not reason:
        return relay
    if reason == "checksum":
        (part / name).unlink()
    stats.fallbacks[reason] += 1
    log.warning("relay peer %s failed on %s of version %d (%s): the rest of the version comes from the controller",
                peer_at, name, ann.version, why)
    return None


class _FileFetcher:
    """Pipelined in-order download of one file at a time (see module docstring)."""

    def __init__(self, send: Send, recv: RecvChunk, version: int, cfg: TransportConfig,
                 source: str = "controller") -> None:
        self.source = source
        self.refusal = ""
        """Reason token of the last refusal received."""
        self.send = send
        self.recv = recv
        self.version = version
        self.cfg = cfg
        self.retry_s = max(0.5, cfg.fetch_timeout_s / 4)
        self.received = 0
        """Bytes that arrived in chunks this fetcher wrote (repeats not counted)."""

    def fetch(self, name: str, path: Path, size: int | None, algo: str) -> str:
        """Append the missing tail of ``name`` to ``path`` until it has ``size`` bytes
        (``size=None``: learn it from the first reply); returns the whole file's ``algo`` digest."""
        if size is not None and path.exists() and path.stat().st_size > size:
            path.unlink()  # longer than the real file: not a prefix of it
        h = new_hasher(algo)
        with open(path, "a+b") as f:
            have = f.tell()
            f.seek(0)
            while piece := f.read(min(BLOCK, have - f.tell())):
                h.update(piece)
            f.seek(have)
            self._loop(name, f, h, have, size)
            f.flush()
            os.fsync(f.fileno())
        return h.hexdigest()

    def _loop(self, name: str, f, h: Hasher, have: int, size: int | None) -> None:  # f: BinaryIO
        chunk = self.cfg.fetch_chunk_bytes
        ahead: dict[int, bytes] = {}
        requested: dict[int, float] = {}
        next_req = have
        last_progress = time.monotonic()
        while size is None or have < size:
            while len(requested) < self.cfg.fetch_window and (not requested if size is None else next_req < size):
                length = chunk if size is None else min(chunk, size - next_req)
                self.send(Fetch(self.version, name, next_req, length).to_frames())
                requested[next_req] = time.monotonic()
                next_req += length
            msg = self.recv(100)
            now = time.monotonic()
            if isinstance(msg, ErrorReply):
                self.refusal = msg.reason
                raise WeightsError("fetch_refused", f"{self.source} refused {name} of version {self.version}: "
                                   f"{msg.reason} {msg.detail}")
            if msg is None or msg.version != self.version or msg.file != name:
                if now - last_progress > self.cfg.fetch_timeout_s:
                    raise WeightsError("fetch_timeout", f"no chunk of {name} (version {self.version}) for "
                                       f"{self.cfg.fetch_timeout_s} s")
                if requested and now - min(requested.values()) > self.retry_s:
                    log.info("re-requesting %s from offset %d", name, have)
                    requested.clear()
                    ahead.clear()
                    next_req = have
                continue
            if size is None:
                size = msg.size
                if size > self.cfg.limits.max_weight_bytes:
                    raise WeightsError("size", f"{name} announces {size} bytes")
            elif msg.size != size:
                raise WeightsError("size", f"{name}: chunk says size {msg.size}, expected {size}")
            requested.pop(msg.offset, None)
            if msg.offset >= have and msg.offset not in ahead:  # the next chunk is written from the frame itself
                ahead[msg.offset] = msg.data if msg.offset == have else bytes(msg.data)
            while have in ahead:
                data = ahead.pop(have)
                if not data and have < size:
                    raise WeightsError("fetch_range", f"empty chunk of {name} at {have} < {size}")
                f.write(data)
                h.update(data)
                have += len(data)
                self.received += len(data)
                last_progress = now
            if have > size:
                raise WeightsError("size", f"{name} grew beyond {size} bytes")
