"""Fair credit serving over real ipc sockets: when admission capacity is the limit, generators
with equal credit share it round-robin instead of the first session taking everything."""

from __future__ import annotations

import time

from test_server import RawGenerator

from vapo_async.transport.messages import Ack, Lease, Request


def _wait(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _leased_to(ctl, generator_id: str) -> int:
    """Prompts currently leased (unreceived) to ``generator_id``, from the controller's ledger."""
    with ctl._lock:
        ident = ctl.state.sessions.by_generator[generator_id]
        return sum(len(ctl.state.ledger.leases[i].open) for i in ctl.state.ledger.by_owner.get(ident, ()))


def _receive_leases(gen: RawGenerator, n_prompts: int) -> list[Lease]:
    """Read messages until leases holding ``n_prompts`` prompts arrived (acks are skipped)."""
    leases: list[Lease] = []
    while sum(len(lease.prompts) for lease in leases) < n_prompts:
        msg = gen.recv()
        if isinstance(msg, Lease):
            leases.append(msg)
        else:
            assert isinstance(msg, Ack) and msg.status == "accepted", msg
    return leases


def _wanted(ctl, generator_id: str) -> int:
    with ctl._lock:
        return ctl.state.sessions.by_ident[ctl.state.sessions.by_generator[generator_id]].wanted


def test_equal_credit_under_capacity_limit_is_shared_round_robin(make_controller, endpoint) -> None:
    B, rounds, credit = 3, 12, 8
    # eta = 0: capacity opens B = 3 slots per optimizer step, less than either generator's credit 8
    ctl = make_controller(n_prompts=40, batch_groups=B, eta=0, lease_timeout_s=30)
    gens = {name: RawGenerator(endpoint, name) for name in ("a", "b")}
    for g in gens.values():
        g.hello(max_prompts=credit)
    try:
        # round 0: "a" asks first and alone, so it gets all 3 initial slots; "b" then waits with credit 8
        gens["a"].sock.send_multipart(Request(credit).to_frames())
        _wait(lambda: _leased_to(ctl, "a") == B, "a's first lease")
        gens["b"].sock.send_multipart(Request(credit).to_frames())
        _wait(lambda: _wanted(ctl, "a") == credit - B and _wanted(ctl, "b") == credit, "b's request")
        shares: list[dict[str, int]] = []
        held = {"a": B, "b": 0}
        for r in range(rounds + 1):
            got = {name: 0 for name in gens}
            for name, g in gens.items():
                for lease in _receive_leases(g, held[name]):
                    got[name] += len(lease.prompts)
                    for p in lease.prompts:
                        g.send_group(lease, p.index)
                g.sock.send_multipart(Request(credit).to_frames())  # credit back to 8 (absolute)
            shares.append(got)
            if r == rounds:
                break
            batch = ctl.next_batch(B, 10)
            ctl.mark_trained(batch)
            # both requests are in before the step opens capacity, so the split sees both sessions
            _wait(lambda: _wanted(ctl, "a") == credit and _wanted(ctl, "b") == credit, "both requests")
            ctl.step_done()
            _wait(lambda: _leased_to(ctl, "a") + _leased_to(ctl, "b") == B, "the next leases")
            held = {name: _leased_to(ctl, name) for name in gens}
        assert shares[0] == {"a": 3, "b": 0}
        # rounds >= 1: supply 3 over 2 sessions = share 1 each + 1 extra for the least recently
        # served. Round 1: "b" was never served -> b 2, a 1; the extra one is stamped last, so
        # round 2: a 2, b 1; and so on, alternating.
        for r, got in enumerate(shares[1:], start=1):
            assert got == ({"a": 1, "b": 2} if r % 2 else {"a": 2, "b": 1}), (r, shares)
        # 12 rounds x 3 slots = 36 = 18 + 18: shares after the first round differ by 0 (<= one chunk)
        total = {name: sum(s[name] for s in shares[1:]) for name in gens}
        assert total == {"a": 18, "b": 18}
        _wait(lambda: ctl.accounting()["buffered"] == B, "the last round's groups")
        acc = ctl.accounting()  # also checks that every admitted item is in exactly one state
        # (rounds + 1) * B = 39 admitted; 12 batches trained, the last round's 3 groups buffered
        assert acc["admitted"] == 39 and acc["trained"] == 36 and acc["buffered"] == 3 and acc.get("reissued", 0) == 0
    finally:
        for g in gens.values():
            g.close()


def test_credit_is_still_filled_when_capacity_allows(make_controller, endpoint) -> None:
    # eta = 1, B = 8: capacity (1 + 1) * 8 = 16 >= credit 10, served as leases of at most
    # max_lease_prompts = 4: 4 + 4 + 2 = 10
    ctl = make_controller(n_prompts=40, batch_groups=8, eta=1, max_lease_prompts=4)
    gen = RawGenerator(endpoint, "solo")
    gen.hello(max_prompts=16)
    try:
        gen.sock.send_multipart(Request(10).to_frames())
        sizes = [len(lease.prompts) for lease in _receive_leases(gen, 10)]
        assert sizes == [4, 4, 2]
        assert _wanted(ctl, "solo") == 0 and ctl.accounting()["leased"] == 10
    finally:
        gen.close()
