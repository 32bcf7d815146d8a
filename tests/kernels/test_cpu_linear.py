"""fp32 CPU linears through oneDNN on a packed weight (one row in C): F.linear's results at odd
shapes and every row count, the bias, a weight changed in place, the dispatch in `gemv.linear`."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_linear, gemv

needs_onednn = pytest.mark.skipif(
    not cpu_linear.available(), reason="this torch has no oneDNN; gemv.linear keeps F.linear"
)


@pytest.fixture(params=[True, False], ids=["c", "onednn"])
def few_rows_in_c(request, monkeypatch) -> bool:
    """Both routes of few-row products, whatever this host's own (`few_rows_in_c`)."""
    monkeypatch.setattr(cpu_linear, "few_rows_in_c", lambda: request.param)
    return request.param


@needs_onednn
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 1, 1),
        (1, 5, 17),
        (1, 37, 1536),
        (3, 5, 17),
        (4, 4, 16),
        (5, 7, 33),
        (9, 13, 576),
        (32, 30, 100),
        (70, 19, 1536),
    ],
)
def test_matches_f_linear(m: int, n: int, k: int, few_rows_in_c: bool, lanes: int) -> None:
    gen = torch.Generator().manual_seed(m * n * k)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n)
    out = cpu_linear.linear_cpu(x, w)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_linear.linear_cpu(x, w, b), F.linear(x, w, b), atol=1e-4,
                               rtol=1e-5)  # fmt: skip


@needs_onednn
def test_a_weight_changed_in_place_is_packed_again() -> None:
    x, w = torch.randn(8, 64), torch.randn(16, 64)
    cpu_linear.linear_cpu(x, w)
    w.mul_(2.0)
    torch.testing.assert_close(cpu_linear.linear_cpu(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


@needs_onednn
def test_strided_x_and_no_rows() -> None:
    x = torch.randn(6, 64)[:, :40]  # row stride 64
    w = torch.randn(8, 40)
    torch.testing.assert_close(cpu_linear.linear_cpu(x, w), F.linear(x, w), atol=1e-4, rtol=0)
    assert cpu_linear.linear_cpu(torch.zeros(0, 40), w).shape == (0, 8)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        cpu_linear.linear_cpu(torch.zeros(4, 8), torch.zeros(3, 9))
    with pytest.raises(ValueError, match="fp32"):
        cpu_linear.linear_cpu(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(3, 8))


@needs_onednn
def test_linear_takes_onednn_for_fp32_without_autograd(monkeypatch) -> None:
    calls = []
    kernel = cpu_linear.linear_cpu
    monkeypatch.setattr(cpu_linear, "linear_cpu",
                        lambda x, w, b: calls.append(len(x)) or kernel(x, w, b))  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(24, 48, generator=gen), torch.randn(24, generator=gen)
    for m in (1, 4, 33):
        x = torch.randn(m, 48, generator=gen)
        torch.testing.assert_close(gemv.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert calls == [1, 4, 33]
    gemv.linear(torch.randn(2, 48, dtype=torch.bfloat16), w.bfloat16(), None)
    gemv.linear(torch.randn(2, 48), w.clone().requires_grad_(), None)
    assert calls == [1, 4, 33]


def _packed_or_skip(w: torch.Tensor) -> cpu_linear.PackedWeight:
    packed = cpu_linear.pack(w)
    if packed is None:
        pytest.skip(f"oneDNN packs a {tuple(w.shape)} weight in another layout on this CPU")
    return packed


@needs_onednn
@pytest.mark.parametrize("n,k", [(5, 17), (64, 16), (100, 37), (130, 200), (832, 576)])
def test_a_weight_held_packed_gives_f_linear_at_every_row_count(
    n: int, k: int, few_rows_in_c: bool, lanes: int
) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = _packed_or_skip(w)
    assert packed.shape == (n, k) and torch.equal(packed.to_dense(), w)
    # NOTE: 1 to 13 rows take every split into 6-row tiles; 64 / 65 the last few-row count
    for m in (*range(1, 14), 17, 32, 33, 64, 65):
        x = torch.randn(m, k, generator=gen)
        torch.testing.assert_close(cpu_linear.linear_packed(x, packed), F.linear(x, w),
                                   atol=2e-4, rtol=1e-5)  # fmt: skip
        torch.testing.assert_close(cpu_linear.linear_packed(x, packed, b), F.linear(x, w, b),
                                   atol=2e-4, rtol=1e-5)  # fmt: skip
    x = torch.randn(2, 3, k, generator=gen)  # leading dimensions kept
    torch.testing.assert_close(cpu_linear.linear_packed(x, packed), F.linear(x, w), atol=2e-4,
                               rtol=1e-5)  # fmt: skip
    assert cpu_linear.linear_packed(torch.zeros(0, k), packed).shape == (0, n)


@needs_onednn
@pytest.mark.parametrize("n,k", [(200, 96), (960, 576)])
def test_a_row_is_the_same_whatever_shares_the_batch(n: int, k: int, lanes: int,
                                                     monkeypatch) -> None:  # fmt: skip
    """Each row of a few-row product, in either build of the C kernels, equals to the bit that
    row alone (the one-row GEMV): a greedy answer does not depend on what shares its batch."""
    monkeypatch.setattr(cpu_linear, "few_rows_in_c", lambda: True)
    if cpu_linear._gemv_library() is None:
        pytest.skip("no C compiler: the few-row kernel is not built")
    gen = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = _packed_or_skip(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for m in (2, 5, 8, 13, cpu_linear.FEW_ROWS_MAX):
            x = torch.randn(m, k, generator=gen)
            together = cpu_linear.linear_packed(x, packed, b)
            for i in range(m):
                assert torch.equal(
                    together[i : i + 1], cpu_linear.linear_packed(x[i : i + 1], packed, b)
                ), (m, i)
            torch.testing.assert_close(together, F.linear(x, w, b), atol=2e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@needs_onednn
def test_a_product_shared_with_lent_threads_is_the_same_to_the_bit(monkeypatch) -> None:
    """Under `lending`, few-row products (decode steps and short prompts alike) split their
    64-column blocks between the caller and the lent C helpers and give exactly what one thread
    gives; products too small to pay for the hand-off stay on the caller's thread."""
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(328, 96, generator=gen), torch.randn(328, generator=gen)
    packed = _packed_or_skip(w)
    shares: list[int] = []
    if cpu_linear._gemv_library() is None:
        pytest.skip("no C compiler: the few-row kernel is not built")
    lent = cpu_linear.LentThreads(2)
    real = lent.product

    def spy(rows, weight, bias, out) -> bool:
        shares.append(rows.shape[0])
        return real(rows, weight, bias, out)

    monkeypatch.setattr(lent, "product", spy)
    monkeypatch.setattr(cpu_linear, "SHARE_MIN_MACS", 0)
    monkeypatch.setattr(cpu_linear, "few_rows_in_c", lambda: True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for m in (1, 2, 7, 37, cpu_linear.FEW_ROWS_MAX):
            x = torch.randn(m, 96, generator=gen)
            alone = cpu_linear.linear_packed(x, packed, b)
            with cpu_linear.lending(lent):
                shared = cpu_linear.linear_packed(x, packed, b)
            assert torch.equal(shared, alone), m
            torch.testing.assert_close(shared, F.linear(x, w, b), atol=2e-4, rtol=1e-5)
        assert shares == [1, 2, 7, 37, cpu_linear.FEW_ROWS_MAX]
        monkeypatch.setattr(cpu_linear, "SHARE_MIN_MACS", 1 << 40)
        with cpu_linear.lending(lent):
            cpu_linear.linear_packed(torch.randn(32, 96, generator=gen), packed, b)
        assert len(shares) == 5  # too little work to share
        monkeypatch.setattr(cpu_linear, "SHARE_MIN_MACS", 0)
        lent.gate = lambda: False  # the lent core is busy now
        with cpu_linear.lending(lent):
            cpu_linear.linear_packed(torch.randn(32, 96, generator=gen), packed, b)
        assert len(shares) == 5
        lent.gate = None
        # more rows go to oneDNN, on the lent threads too: the embedded model's MLP shapes
        monkeypatch.setattr(cpu_linear, "SHARE_MIN_MACS", 1 << 17)
        threads_seen: list[int] = []
        onednn = cpu_linear._onednn
        monkeypatch.setattr(cpu_linear, "_onednn",
                            lambda *a: threads_seen.append(torch.get_num_threads()) or onednn(*a))  # fmt: skip
        for n, k in ((1536, 576), (576, 1536)):
            w2 = torch.randn(n, k, generator=gen)
            packed2 = _packed_or_skip(w2)
            x = torch.randn(cpu_linear.FEW_ROWS_MAX + 37, k, generator=gen)
            alone = cpu_linear.linear_packed(x, packed2)
            with cpu_linear.lending(lent):
                shared = cpu_linear.linear_packed(x, packed2)
            assert torch.equal(shared, alone), (n, k)
        assert threads_seen == [1, 3, 1, 3] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
        lent.close()


@needs_onednn
def test_lent_helpers_bound_to_cores_sleep_and_wake(monkeypatch) -> None:
    """A helper bound to a core shares products after sleeping between them (a gap past its
    spin), and several engines' helper teams work side by side; a closed team leaves the
    products to the caller."""
    if cpu_linear._gemv_library() is None:
        pytest.skip("no C compiler: the few-row kernel is not built")
    monkeypatch.setattr(cpu_linear, "few_rows_in_c", lambda: True)
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(640, 96, generator=gen)
    packed = _packed_or_skip(w)
    cores = tuple(sorted(os.sched_getaffinity(0)))[:1] if hasattr(os, "sched_getaffinity") else None
    teams = [cpu_linear.LentThreads(1, cores), cpu_linear.LentThreads(3)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        x = torch.randn(3, 96, generator=gen)
        alone = cpu_linear.linear_packed(x, packed)
        for _ in range(3):
            time.sleep(0.002)  # past the helpers' spin: they sleep, and are woken
            for team in teams:
                with cpu_linear.lending(team):
                    assert torch.equal(cpu_linear.linear_packed(x, packed), alone)
        teams[0].close()
        assert not teams[0].product(x.contiguous(), packed, None, torch.empty(3, 640))
        with cpu_linear.lending(teams[0]):
            assert torch.equal(cpu_linear.linear_packed(x, packed), alone)
    finally:
        torch.set_num_threads(threads)
        for team in teams:
            team.close()


@needs_onednn
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_computes_lent_products_alone(monkeypatch) -> None:
    """A process forked from an engine has none of its parent's helper threads: its products
    under `lending` run whole on its own thread (the same result, never a wait on a helper
    that is not there)."""
    if cpu_linear._gemv_library() is None:
        pytest.skip("no C compiler: the few-row kernel is not built")
    monkeypatch.setattr(cpu_linear, "few_rows_in_c", lambda: True)
    gen = torch.Generator().manual_seed(13)
    w, x = torch.randn(640, 96, generator=gen), torch.randn(4, 96, generator=gen)
    packed = _packed_or_skip(w)
    lent = cpu_linear.LentThreads(1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with cpu_linear.lending(lent):
            expected = cpu_linear.linear_packed(x, packed)
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only with the right product
            code = 1
            try:
                with cpu_linear.lending(lent):
                    code = 0 if torch.equal(cpu_linear.linear_packed(x, packed), expected) else 1
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
        assert lent.shared == 1  # the parent's product only
    finally:
        torch.set_num_threads(threads)
        lent.close()


@needs_onednn
def test_a_few_rows_on_one_thread_skip_onednn(monkeypatch) -> None:
    """Decode batches of 2 to FEW_ROWS_MAX rows on one compute thread (the default 2-core engine)
    run the few-row C kernel; more rows, or more threads, run oneDNN."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 96, generator=gen)
    packed = _packed_or_skip(w)
    calls: list[int] = []
    onednn = cpu_linear._onednn
    monkeypatch.setattr(
        cpu_linear, "_onednn", lambda x, *a: calls.append(x.shape[0]) or onednn(x, *a)
    )
    monkeypatch.setattr(cpu_linear, "few_rows_in_c", lambda: True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for m in (2, 8, cpu_linear.FEW_ROWS_MAX, cpu_linear.FEW_ROWS_MAX + 1):
            x = torch.randn(m, 96, generator=gen)
            torch.testing.assert_close(cpu_linear.linear_packed(x, packed), F.linear(x, w),
                                       atol=2e-4, rtol=1e-5)  # fmt: skip
        assert calls == [cpu_linear.FEW_ROWS_MAX + 1]
        torch.set_num_threads(2)
        cpu_linear.linear_packed(torch.randn(8, 96, generator=gen), packed)
        assert calls == [cpu_linear.FEW_ROWS_MAX + 1, 8]
    finally:
        torch.set_num_threads(threads)


@needs_onednn
def test_without_the_c_kernels_every_product_takes_onednn(monkeypatch) -> None:
    """On a host where the C kernels are not taken (x86-64 below AVX2) every product, one row
    included, runs oneDNN; a prompt's products under `lending` run it on the lent threads too
    when they are worth sharing, and give what one thread gives, to the bit."""
    monkeypatch.setattr(cpu_linear, "few_rows_in_c", lambda: False)
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(1536, 576, generator=gen)
    packed, small = _packed_or_skip(w), _packed_or_skip(torch.randn(200, 96, generator=gen))
    seen: list[tuple[int, int]] = []
    onednn = cpu_linear._onednn
    monkeypatch.setattr(cpu_linear, "_onednn", lambda x, *a: seen.append(
        (x.shape[0], torch.get_num_threads())) or onednn(x, *a))  # fmt: skip
    threads = torch.get_num_threads()
    lent = cpu_linear.LentThreads(1)
    try:
        torch.set_num_threads(1)
        for m in (1, 2, cpu_linear.FEW_ROWS_MAX):
            x = torch.randn(m, 576, generator=gen)
            torch.testing.assert_close(cpu_linear.linear_packed(x, packed), F.linear(x, w),
                                       atol=2e-4, rtol=1e-5)  # fmt: skip
            torch.testing.assert_close(cpu_linear.linear_cpu(x, w), F.linear(x, w), atol=2e-4,
                                       rtol=1e-5)  # fmt: skip
        assert [m for m, _ in seen] == [1, 1, 2, 2, 64, 64]
        seen.clear()
        x = torch.randn(cpu_linear.FEW_ROWS_MAX, 576, generator=gen)
        alone = cpu_linear.linear_packed(x, packed)
        with cpu_linear.lending(lent):
            shared = cpu_linear.linear_packed(x, packed)
            cpu_linear.linear_packed(x[:1], packed)  # a decode step's row
            cpu_linear.linear_packed(x[:1, :96], small)  # too little work to hand over
        assert torch.equal(shared, alone)
        assert seen == [(64, 1), (64, 2), (1, 2), (1, 1)] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
        lent.close()


def test_pack_declines_what_linear_cpu_would_not_take() -> None:
    assert cpu_linear.pack(torch.randn(8, 16, dtype=torch.bfloat16)) is None
    assert cpu_linear.pack(torch.randn(8, 16, requires_grad=True)) is None
    assert cpu_linear.pack(torch.randn(2, 8, 16)) is None


@needs_onednn
def test_a_loaded_fp32_layer_keeps_one_copy_of_its_weight() -> None:
    from loraplex.platform.models.linear import Linear

    layer = Linear(576, [576, 128, 128])
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(832, 576, generator=gen))
    weight = layer.weight.clone()
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(4, 576, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, weight), atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(layer(x[:1]), F.linear(x[:1], weight), atol=2e-4, rtol=1e-5)
    assert torch.equal(layer.method.dequantized_weight(layer), weight)
    if "packed_weight" not in layer.__dict__:
        pytest.skip("oneDNN packs this weight in another layout on this CPU: it stays plain")
    assert "weight" not in dict(layer.named_parameters())
