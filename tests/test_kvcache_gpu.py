"""attention_kvcache's kernels on a CUDA GPU against the float64 reference (itself proven against
the dense reference in tests/test_kvcache.py), under the precision standard. Outputs come from
torch.empty, which conftest poisons with NaN, so an element the kernels never write fails."""

import pytest
import torch

import flashsink
from flashsink import reference
from flashsink.testing import assert_precision, dtype_name

from gpu_cases import KVCase, combine_splits, kvcache_cases, merge_test_config

pytestmark = pytest.mark.gpu


def _ident(c):
    pages = "contig" if c.page_size is None else f"P{c.page_size}"
    w = "Wnone" if c.window is None else f"W{c.window}"
    return (f"{c.name}:B{len(c.lengths)}-H{c.heads}-HK{c.kv_heads}-Q{c.seq_q}-K{max(c.lengths)}-D{c.head_dim}-"
            f"{pages}-{w}{'' if c.sinks else '-nosink'}-{dtype_name(c.dtype)}")


def make_cache(c: KVCase, seed: int = 0, spare: int = 5, device: str = "cuda"):
    """q, a cache filled with random values everywhere (unused rows too), cache_seqlens and a
    random block table (pages in random order; garbage past each row's used pages), on ``device``."""
    g = torch.Generator().manual_seed(seed)
    B, D = len(c.lengths), c.head_dim
    lengths = torch.tensor(c.lengths, dtype=torch.int32)
    if c.page_size is None:
        shape, table = (B, max(c.lengths) + 3, c.kv_heads, D), None
    else:
        used = [-(-n // c.page_size) for n in c.lengths]
        num_pages = sum(used) + spare
        max_pages = max(used) + 2
        perm = torch.randperm(num_pages, generator=g)
        table = torch.randint(-10**6, 10**6, (B, max_pages), generator=g, dtype=torch.int32)  # garbage
        start = 0
        for b, u in enumerate(used):
            table[b, :u] = perm[start : start + u]
            start += u
        if c.shared:  # prefix sharing: every row reads row 0's first pages where both have them
            for b in range(1, B):
                n = min(used[0], used[b]) - 1  # whole pages only: row b's last page stays its own
                if n > 0:
                    table[b, :n] = table[0, :n]
        shape = (num_pages, c.page_size, c.kv_heads, D)
    k = torch.randn(shape, generator=g).to(c.dtype)
    v = torch.randn(shape, generator=g).to(c.dtype)
    q = torch.randn(B, c.seq_q, c.heads, D, generator=g).to(c.dtype)
    sinks = (torch.rand(c.heads, generator=g) * 4 - 2) if c.sinks else None
    return dict(q=q.to(device), k_cache=k.to(device), v_cache=v.to(device), cache_seqlens=lengths.to(device),
                block_table=None if table is None else table.to(device), sinks=None if sinks is None else sinks.to(device),
                layout="bshd")


def run_both(c, inp):
    got = flashsink.attention_kvcache(
        inp["q"], inp["k_cache"], inp["v_cache"], inp["cache_seqlens"], block_table=inp["block_table"],
        sinks=inp["sinks"], window=c.window, layout="bshd", return_lse=True,
    )
    d = {k: (v.double() if k in ("q", "k_cache", "v_cache") else v) for k, v in inp.items()}
    want = reference.attention_kvcache(
        d["q"], d["k_cache"], d["v_cache"], d["cache_seqlens"], block_table=d["block_table"],
        sinks=None if d["sinks"] is None else d["sinks"].double(), window=c.window, layout="bshd", return_lse=True,
    )
    return got, want


@pytest.mark.l1
@pytest.mark.parametrize("c", kvcache_cases(), ids=_ident)
def test_kvcache(c):
    inp = make_cache(c)
    (o, lse), (want_o, want_lse) = run_both(c, inp)
    assert o.shape == want_o.shape and o.dtype == c.dtype and lse.dtype == torch.float32
    assert_precision("o", o, want_o, c.dtype)
    assert_precision("lse", lse, want_lse, c.dtype)


@pytest.mark.l1
def test_no_recompile_across_lengths_and_page_sizes():
    """Lengths, batch size, chunk length, page size and the number of pages are runtime values."""
    from flashsink.ops.compiler.registry import cache_size

    base = KVCase(64, 8, 64, torch.bfloat16, (100,), 16)
    flashsink.attention_kvcache(**make_cache(base))
    before = cache_size()
    for i, (ps, lens, sq) in enumerate([(16, (1, 5000), 1), (32, (77,), 3), (256, (9000, 1, 2), 1),
                                        (48, (300,), 64), (None, (4000, 12), 2)]):
        flashsink.attention_kvcache(**make_cache(KVCase(64, 8, 64, torch.bfloat16, lens, ps, seq_q=sq), seed=i))
    assert cache_size() == before


@pytest.mark.boundary
def test_bad_values_give_nan_rows_without_faults():
    """On CUDA the values are checked on the device: a length past the capacity makes its batch row
    NaN (o and lse), a used page index out of range makes the rows that see its keys NaN; the other
    rows are still right, and nothing reads out of bounds (a fault would fail the sync below)."""
    c = KVCase(8, 2, 64, torch.bfloat16, (100, 50, 70), 16)
    inp = make_cache(c)
    cap = inp["block_table"].shape[1] * 16
    inp["cache_seqlens"] = torch.tensor([100, cap + 1, 70], dtype=torch.int32, device="cuda")
    inp["block_table"][2, 1] = 10**6  # row 2 uses pages 0..4
    o, lse = flashsink.attention_kvcache(**inp, return_lse=True)
    torch.cuda.synchronize()
    assert o[1].isnan().all() and lse[1].isnan().all()
    assert o[2].isnan().all() and lse[2].isnan().all()  # its one query sees every key, page 1's too
    inp["cache_seqlens"][1], inp["cache_seqlens"][2] = 50, 70
    good = {k: v[:1] if k in ("q", "cache_seqlens", "block_table") else v for k, v in inp.items()}
    (want_o, want_lse) = run_both(KVCase(8, 2, 64, torch.bfloat16, (100,), 16), good)[1]
    assert_precision("o", o[:1], want_o, c.dtype)
    assert_precision("lse", lse[:1], want_lse, c.dtype)


@pytest.mark.boundary
def test_merge_kernel_nonfinite_as_combine_splits():
    """The merge kernel against its torch twin gpu_cases.combine_splits on sinks +inf, -inf, NaN and
    finite, splits with no key holding NaN, and rows where every split is empty."""
    from flashsink.ops.compiler.registry import get_kernel
    from flashsink.kernel_config import arch_of

    g = torch.Generator().manual_seed(3)
    B, H, Sq, S, D = 2, 4, 3, 5, 64
    o_part = torch.randn(B, H, Sq, S, D, generator=g)
    lse_part = torch.randn(B, H, Sq, S, generator=g) * 3
    lse_part[:, :, :, 1] = float("-inf")
    o_part[:, :, :, 1] = float("nan")
    lse_part[1, :, 2] = float("-inf")  # a row with no key in any split
    o_part[1, :, 2] = float("nan")
    sinks = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.7])
    cfg = merge_test_config(arch_of(torch.device("cuda")))
    o = torch.empty(B, H, Sq, D, device="cuda")
    lse = torch.empty(B, H, Sq, device="cuda")
    get_kernel("merge_splits", cfg)(o_part.cuda(), lse_part.cuda(), sinks.cuda(), o, lse)
    want_o, want_lse = combine_splits(o_part, lse_part, sinks, True)
    for got, want in ((o.cpu(), want_o), (lse.cpu(), want_lse)):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isposinf(), want.isposinf())
        assert torch.equal(got.isneginf(), want.isneginf())
        fin = want.isfinite()
        assert_precision("merge", got[fin], want[fin], torch.float32)
