"""GAE: vectorised vs the plain float64 loop, hand-derived values, padding poison, dtypes."""

from __future__ import annotations

import pytest
import torch
from algo_reference import gae_loop, random_mask, scan_loop

from vapo_async.algo.advantages import gae, length_adaptive_lambda, place_terminal_rewards
from vapo_async.algo.fast import numba_gae as gae_cpu
from vapo_async.algo.fast.scan import reverse_scan

BACKENDS = [
    pytest.param("compiled", marks=pytest.mark.skipif(not gae_cpu.numba_available(), reason="numba not installed")),
    "torch",
    "reference",
]
"""Every implementation of ``gae`` (the two fast paths and the readable loop) runs every test that
takes ``backend``."""


def _random_case(seed: int, b: int, t: int, layouts: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64)
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = random_mask(gen, b, t, layouts)
    lam = torch.rand(b, generator=gen, dtype=torch.float64)
    lam[0], lam[1], lam[2] = 0.0, 1.0, 0.95  # exact ends of the range and the PPO value
    return rewards, values, mask, lam


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize(
    ("b", "t", "layouts"),
    [
        (24, 50, ("right", "left", "gaps")),
        (12, 300, ("right", "left", "middle", "gaps")),  # several chunk levels, T not a multiple of 16
        (9, 16, ("right", "left", "gaps")),  # exactly one chunk
        (9, 17, ("right", "left")),  # one chunk plus a remainder
        (5, 1, ("right",)),
    ],
)
def test_gae_matches_python_loop(backend: str, gamma: float, b: int, t: int, layouts: tuple[str, ...]) -> None:
    rewards, values, mask, lam = _random_case(seed=t * 31 + b, b=b, t=t, layouts=layouts)
    adv, ret = gae(rewards, values, mask, gamma, lam, backend=backend)
    ref_adv, ref_ret = gae_loop(rewards, values, mask, gamma, lam.tolist())
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=1e-10)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=0, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_matches_loop_on_a_poisoned_mixed_batch(backend: str) -> None:
    # Every layout in one batch, lambdas 0 / 1 / 0.95 / uniform / length-adaptive, gamma < 1, and
    # padding holding NaN (even rows) or 1e30 (odd rows): float64 equals the loop to 1e-10, float32
    # to float32 rounding (|A| <~ 50 here, relative error ~1e-7 per step).
    b, t = 40, 257
    rewards, values, mask, lam = _random_case(seed=11, b=b, t=t, layouts=("right", "left", "middle", "gaps"))
    lam[20:] = length_adaptive_lambda(mask[20:].sum(1), 0.05, dtype=torch.float64)
    ref_adv, ref_ret = gae_loop(rewards, values, mask, 0.97, lam.tolist())
    ref_adv_t, ref_ret_t = (torch.tensor(x, dtype=torch.float64) for x in (ref_adv, ref_ret))
    poison = torch.where(torch.arange(b)[:, None] % 2 == 0, float("nan"), 1e30).expand(b, t)
    r_bad, v_bad = torch.where(mask, rewards, poison), torch.where(mask, values, poison)
    adv, ret = gae(r_bad, v_bad, mask, 0.97, lam, backend=backend)
    torch.testing.assert_close(adv, ref_adv_t, rtol=0, atol=1e-10)
    torch.testing.assert_close(ret, ref_ret_t, rtol=0, atol=1e-10)
    adv32, ret32 = gae(r_bad.float(), v_bad.float(), mask, 0.97, lam.float(), backend=backend)
    assert adv32.dtype == torch.float32
    torch.testing.assert_close(adv32.double(), ref_adv_t, rtol=0, atol=2e-4)
    torch.testing.assert_close(ret32.double(), ref_ret_t, rtol=0, atol=2e-4)


@pytest.mark.skipif(not gae_cpu.numba_available(), reason="numba not installed")
def test_compiled_row_blocks_on_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # 7 rows over 3 threads (blocks of 2, 2, 3 rows): rows are independent, so the result must be
    # bit-identical to one thread, and equal to the loop.
    rewards, values, mask, lam = _random_case(seed=4, b=7, t=90, layouts=("right", "left", "gaps"))
    x = 0.9 * lam
    one = (torch.empty(7, 90, dtype=torch.float64), torch.empty(7, 90, dtype=torch.float64))
    three = (torch.full((7, 90), 5.0, dtype=torch.float64), torch.full((7, 90), 5.0, dtype=torch.float64))
    valid = mask.view(torch.uint8)
    gae_cpu.gae_rows_compiled(rewards, values, valid, x, 0.9, *one, threads=1)
    monkeypatch.setattr(gae_cpu, "MIN_ELEMS_PER_THREAD", 1)
    gae_cpu.gae_rows_compiled(rewards, values, valid, x, 0.9, *three, threads=3)
    assert torch.equal(one[0], three[0]) and torch.equal(one[1], three[1])
    ref_adv, _ = gae_loop(rewards, values, mask, 0.9, lam.tolist())
    torch.testing.assert_close(three[0], torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="valid must be"):
        gae_cpu.gae_rows_compiled(rewards, values, mask, x, 0.9, *one)  # bool, not uint8


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    rewards, values, mask, lam = _random_case(seed=6, b=6, t=30, layouts=("right", "gaps"))
    with pytest.raises(ValueError, match="backend must be"):
        gae(rewards, values, mask, 1.0, lam, backend="numpy")  # type: ignore[arg-type]
    torch_adv, torch_ret = gae(rewards, values, mask, 1.0, lam, backend="torch")
    monkeypatch.setattr(gae_cpu, "numba_available", lambda: False)
    with pytest.raises(ValueError, match="needs CPU tensors and numba"):
        gae(rewards, values, mask, 1.0, lam, backend="compiled")
    adv, ret = gae(rewards, values, mask, 1.0, lam)  # auto without numba: the torch scan, bit for bit
    assert torch.equal(adv, torch_adv) and torch.equal(ret, torch_ret)


def test_gae_scalar_lambda_equals_per_row_tensor() -> None:
    rewards, values, mask, _ = _random_case(seed=3, b=10, t=40, layouts=("right", "left"))
    a1, r1 = gae(rewards, values, mask, 1.0, 0.8)
    a2, r2 = gae(rewards, values, mask, 1.0, torch.full((10,), 0.8, dtype=torch.float64))
    assert torch.equal(a1, a2) and torch.equal(r1, r2)


def test_reverse_scan_with_carry_matches_loop() -> None:
    gen = torch.Generator().manual_seed(7)
    for t in (1, 15, 16, 33, 256, 700):
        d = torch.randn(6, t, generator=gen, dtype=torch.float64)
        x = torch.tensor([0.0, 1.0, 0.5, 0.99, 0.01, 0.3], dtype=torch.float64)
        carry = torch.randn(6, generator=gen, dtype=torch.float64)
        out = reverse_scan(d, x, carry)
        torch.testing.assert_close(out, torch.tensor(scan_loop(d, x.tolist(), carry.tolist()), dtype=torch.float64), rtol=0, atol=1e-10)
        assert torch.equal(out[0, :-1], d[0, :-1]), "x = 0 must return d exactly (before the carried last token)"


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_derived_small_case(backend: str) -> None:
    # T = 3, gamma = 1, lambda = 0.5, dyadic numbers so every step is exact in float32.
    # V = [0.5, 0.25, 0.75], r = [0, 0, 1]
    # delta = [0 + 0.25 - 0.5, 0 + 0.75 - 0.25, 1 + 0 - 0.75] = [-0.25, 0.5, 0.25]
    # A_2 = 0.25; A_1 = 0.5 + 0.5 * 0.25 = 0.625; A_0 = -0.25 + 0.5 * 0.625 = 0.0625
    # returns = A + V = [0.5625, 0.875, 1.0]
    values = torch.tensor([[0.5, 0.25, 0.75]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, 1.0, 0.5, backend=backend)
    assert adv.tolist() == [[-0.25 + 0.5 * 0.625, 0.625, 0.25]]
    assert ret.tolist() == [[0.5625, 0.875, 1.0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_lambda_one_gamma_one_returns_are_the_terminal_reward(backend: str) -> None:
    # lambda = gamma = 1: A_t = sum_{k>=t} delta_k telescopes to R - V_t, so returns_t = R on
    # every valid token, whatever the values (Monte-Carlo target of value-pretraining).
    gen = torch.Generator().manual_seed(0)
    mask = random_mask(gen, 8, 30, ("right", "left", "middle"))
    values = torch.randn(8, 30, generator=gen, dtype=torch.float64)
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0, -3.0, 0.0, 1.0, 7.0], dtype=torch.float64)
    rewards = place_terminal_rewards(scores, mask)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0, backend=backend)
    expected = torch.where(mask, scores[:, None].expand(8, 30), torch.zeros(()))
    torch.testing.assert_close(ret, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(adv, torch.where(mask, expected - values, torch.zeros(())), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lambda_zero_gives_exactly_the_td_residual(backend: str) -> None:
    # lambda = 0: A_t = delta_t = r_t + V_{t+1} - V_t (gamma = 1), bit for bit.
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(4, 40, generator=gen)
    rewards = torch.randn(4, 40, generator=gen)
    mask = torch.zeros(4, 40, dtype=torch.bool)
    mask[0, :40] = True
    mask[1, :17] = True
    mask[2, 5:] = True
    mask[3, 3:30] = True
    adv, _ = gae(rewards, values, mask, 1.0, 0.0, backend=backend)
    v_next = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(4, 1)], dim=1)
    delta = (rewards - values) + v_next
    assert torch.equal(adv, torch.where(mask, delta, torch.zeros(())))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gapped_rows_skip_the_gaps(backend: str) -> None:
    # A row 1 0 1 behaves exactly like the row 1 1 with its valid tokens moved together.
    rewards = torch.tensor([[0.0, 99.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, -7.0, 0.25], [0.5, 0.25, 0.0]])
    gapped = torch.tensor([[True, False, True]])
    packed = torch.tensor([[True, True, False]])
    a_gap, r_gap = gae(rewards[:1], values[:1], gapped, 1.0, 0.7, backend=backend)
    a_pack, r_pack = gae(rewards[1:], values[1:], packed, 1.0, 0.7, backend=backend)
    assert a_gap[0, [0, 2]].tolist() == a_pack[0, :2].tolist() and a_gap[0, 1] == 0
    assert r_gap[0, [0, 2]].tolist() == r_pack[0, :2].tolist() and r_gap[0, 1] == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layouts", [("right",), ("left",), ("middle", "gaps")])
def test_padding_poison_changes_nothing(layouts: tuple[str, ...], backend: str) -> None:
    gen = torch.Generator().manual_seed(5)
    b, t = 16, 70
    rewards = torch.randn(b, t, generator=gen)
    values = torch.randn(b, t, generator=gen)
    mask = random_mask(gen, b, t, layouts)
    lam = length_adaptive_lambda(mask.sum(1), 0.05)
    clean = gae(torch.where(mask, rewards, 0.0), torch.where(mask, values, 0.0), mask, 1.0, lam, backend=backend)
    for poison in (float("nan"), 1e30, float("-inf")):
        poisoned = gae(torch.where(mask, rewards, poison), torch.where(mask, values, poison), mask, 1.0, lam, backend=backend)
        for got, want in zip(poisoned, clean, strict=True):
            assert torch.equal(got, want), f"padding value {poison} changed an output"
            assert torch.all(got[~mask] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_valid_token_is_not_hidden(backend: str) -> None:
    values = torch.zeros(2, 5)
    values[0, 2] = float("nan")
    adv, _ = gae(torch.zeros(2, 5), values, torch.ones(2, 5, dtype=torch.bool), 1.0, 0.9, backend=backend)
    assert adv[0, :3].isnan().all() and torch.isfinite(adv[1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtypes_bfloat16_and_mixed(backend: str) -> None:
    gen = torch.Generator().manual_seed(2)
    rewards = torch.randn(6, 33, generator=gen)
    values = torch.randn(6, 33, generator=gen)
    mask = random_mask(gen, 6, 33, ("right", "left"))
    ref_adv, ref_ret = gae(rewards, values, mask, 1.0, 0.9, backend=backend)
    adv, ret = gae(rewards.bfloat16(), values.bfloat16(), mask, 1.0, 0.9, backend=backend)
    assert adv.dtype == torch.bfloat16 and ret.dtype == torch.bfloat16
    # only the bfloat16 rounding of inputs and outputs differs (computed in float32 inside)
    exp_adv, _ = gae(rewards.bfloat16().float(), values.bfloat16().float(), mask, 1.0, 0.9, backend=backend)
    torch.testing.assert_close(adv.float(), exp_adv, rtol=1e-2, atol=1e-2)
    adv_mixed, _ = gae(rewards, values.double(), mask.int(), 1.0, 0.9, backend=backend)
    assert adv_mixed.dtype == torch.float64
    torch.testing.assert_close(adv_mixed.float(), ref_adv, rtol=1e-5, atol=1e-5)
    assert ref_ret.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_buffers_and_errors(backend: str) -> None:
    rewards, values, mask, lam = _random_case(seed=9, b=5, t=20, layouts=("right",))
    adv_buf, ret_buf = torch.full((5, 20), 3.0, dtype=torch.float64), torch.full((5, 20), 3.0, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, 1.0, lam, out=(adv_buf, ret_buf), backend=backend)
    assert adv is adv_buf and ret is ret_buf
    ref_adv, _ = gae(rewards, values, mask, 1.0, lam, backend=backend)
    assert torch.equal(adv, ref_adv)
    with pytest.raises(ValueError, match="lambda"):
        gae(rewards, values, mask, 1.0, 1.5, backend=backend)
    with pytest.raises(ValueError, match="gamma"):
        gae(rewards, values, mask, 1.1, 0.5, backend=backend)
    with pytest.raises(ValueError, match="lam must be"):
        gae(rewards, values, mask, 1.0, torch.zeros(4), backend=backend)
    with pytest.raises(ValueError, match="out buffers"):
        gae(rewards, values, mask, 1.0, lam, out=(torch.empty(5, 20), torch.empty(5, 20)))


def test_length_adaptive_lambda_values() -> None:
    # 1 - 1/(0.05 * 100) = 1 - 1/5 = 0.8; 1 - 1/(0.05 * 40) = 0.5; L <= 20 -> <= 0 -> clamped 0.
    lam = length_adaptive_lambda(torch.tensor([100, 40, 21, 20, 5, 0]), 0.05, dtype=torch.float64)
    assert lam[:2].tolist() == [0.8, 0.5]
    assert abs(lam[2].item() - (1 - 1 / 1.05)) < 1e-15
    assert lam[3:].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(torch.tensor([3]), 0.0)


def test_place_terminal_rewards() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    out = place_terminal_rewards(torch.tensor([2.0, -1.0, 5.0, 3.0]), mask)
    assert out.tolist() == [[0, 2, 0, 0], [0, 0, 0, -1], [0, 0, 0, 0], [0, 0, 3, 0]]
