"""attention_kvcache on the CPU: its reference (paged and contiguous caches) proven against the
dense reference on each sequence's gathered keys, and the validation at the door. The kernels
themselves are judged in tests/test_kvcache_gpu.py."""

import pytest
import torch

import flashsink
from flashsink import reference

H, HK, D = 8, 2, 16


def paged_problem(lengths, page_size, *, seq_q=1, dtype=torch.float64, seed=0, share=True, spare=3):
    """Random q, a random paged cache and a random block table (pages in shuffled order, the first
    page of row 0 shared by every row that is long enough when ``share``, unused entries holding
    garbage), and the same keys per row as contiguous ``[1, n, H_kv, D]`` tensors built key by key."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    used = [-(-n // page_size) for n in lengths]
    max_pages = max(used + [1]) + 1
    num_pages = sum(used) + spare
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((B, max_pages), -7, dtype=torch.int32)  # garbage past the used pages
    for b in range(B):
        for j in range(used[b]):
            table[b, j] = perm.pop()
    if share:  # prefix sharing: every row whose first page is full reads row 0's first page
        for b in range(1, B):
            if lengths[b] >= page_size and lengths[0] >= page_size:
                table[b, 0] = table[0, 0]
    k_cache = torch.randn(num_pages, page_size, HK, D, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, HK, D, generator=g).to(dtype)
    q = torch.randn(B, seq_q, H, D, generator=g).to(dtype)
    seqs = []
    for b, n in enumerate(lengths):
        rows = [int(table[b, j // page_size]) for j in range(n)]
        k = torch.stack([k_cache[p, j % page_size] for j, p in enumerate(rows)]) if n else k_cache[0, :0]
        v = torch.stack([v_cache[p, j % page_size] for j, p in enumerate(rows)]) if n else v_cache[0, :0]
        seqs.append((k.unsqueeze(0), v.unsqueeze(0)))
    return q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32), table, seqs


def dense(q, seqs, sinks, window):
    outs, lses = zip(*(
        reference.attention(q[b : b + 1], k, v, sinks, window=window, causal=True, layout="bshd", return_lse=True)
        for b, (k, v) in enumerate(seqs)
    ))
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.l0
@pytest.mark.parametrize("page_size", [1, 16, 48])
@pytest.mark.parametrize("seq_q", [1, 5])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("sinks_on", [True, False], ids=["sink", "nosink"])
def test_paged_reference_is_the_dense_reference(page_size, seq_q, window, sinks_on):
    """Per batch row, exactly the dense reference on that row's keys gathered key by key (rows of
    different lengths, shared pages, garbage past the used pages, a row shorter than S_q and an
    empty row, whose queries see no key: o = 0, lse = the sink)."""
    lengths = [100, 33, 3, 0, 64]
    q, kc, vc, seqlens, table, seqs = paged_problem(lengths, page_size, seq_q=seq_q)
    sinks = torch.randn(H, dtype=torch.float64) if sinks_on else None
    o, lse = reference.attention_kvcache(q, kc, vc, seqlens, layout="bshd", block_table=table, sinks=sinks,
                                         window=window, return_lse=True)
    want_o, want_lse = dense(q, seqs, sinks, window)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    assert o.shape == (5, seq_q, H, D) and lse.shape == (5, H, seq_q)
    assert (o[3] == 0).all()


@pytest.mark.l0
def test_contiguous_cache_is_the_paged_one():
    """``[B, S_max, H_kv, D]`` without a block table: row b reads its own batch row of the cache."""
    lengths = [20, 1, 37]
    q, kc, vc, seqlens, table, seqs = paged_problem(lengths, 8, seq_q=2, seed=3)
    s_max = 40
    k = torch.randn(3, s_max, HK, D, dtype=torch.float64)
    v = torch.randn(3, s_max, HK, D, dtype=torch.float64)
    for b, (kb, vb) in enumerate(seqs):
        k[b, : lengths[b]], v[b, : lengths[b]] = kb[0], vb[0]
    sinks = torch.randn(H, dtype=torch.float64)
    o, lse = reference.attention_kvcache(q, k, v, seqlens, layout="bshd", sinks=sinks, window=9, return_lse=True)
    want_o, want_lse = reference.attention_kvcache(q, kc, vc, seqlens, layout="bshd", block_table=table, sinks=sinks,
                                                   window=9, return_lse=True)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


@pytest.mark.l0
def test_public_function_off_cuda_is_the_reference():
    q, kc, vc, seqlens, table, _ = paged_problem([50, 17], 16, seq_q=3, dtype=torch.bfloat16)
    sinks = torch.randn(H)
    o = flashsink.attention_kvcache(q, kc, vc, seqlens, layout="bshd", block_table=table, sinks=sinks, window=20)
    want = reference.attention_kvcache(q, kc, vc, seqlens, layout="bshd", block_table=table, sinks=sinks, window=20)
    assert o.dtype == torch.bfloat16 and torch.equal(o, want)


@pytest.mark.l0
def test_forward_only():
    """No autograd: an input that requires grad while grad mode is on is refused, not silently
    detached; under no_grad / inference_mode the same call runs."""
    q, kc, vc, seqlens, table, _ = paged_problem([10], 4, dtype=torch.float32)
    sinks = torch.zeros(H, requires_grad=True)
    with pytest.raises(NotImplementedError, match="forward only.*sinks requires grad"):
        flashsink.attention_kvcache(q, kc, vc, seqlens, layout="bshd", block_table=table, sinks=sinks)
    with pytest.raises(NotImplementedError, match="q requires grad"):
        reference.attention_kvcache(q.requires_grad_(), kc, vc, seqlens, layout="bshd", block_table=table)
    with torch.no_grad():
        flashsink.attention_kvcache(q, kc, vc, seqlens, layout="bshd", block_table=table, sinks=sinks)
    with torch.inference_mode():
        flashsink.attention_kvcache(q, kc, vc, seqlens, layout="bshd", block_table=table, sinks=sinks)


def _args():
    q, kc, vc, seqlens, table, _ = paged_problem([10, 30], 16, dtype=torch.float32)
    return dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=seqlens, block_table=table, sinks=torch.zeros(H),
                layout="bshd")


_BAD = [
    ("q", lambda a: a["q"][0], ValueError, "q must be 4-D"),
    ("q", lambda a: a["q"].to(torch.int32), TypeError, "q must have a floating-point dtype"),
    ("k_cache", lambda a: a["k_cache"].half(), ValueError, "q, k_cache and v_cache must share one dtype"),
    ("k_cache", lambda a: a["k_cache"][0], ValueError, r"k_cache must be 4-D \[num_pages, page_size"),
    ("v_cache", lambda a: a["v_cache"][:-1], ValueError, "v_cache must match k_cache"),
    ("k_cache", lambda a: a["k_cache"][..., :8], ValueError, "k_cache head_dim"),
    ("q", lambda a: a["q"][:, :, :7], ValueError, r"q heads \(7\) must be a multiple of k/v heads \(2\)"),
    ("cache_seqlens", lambda a: a["cache_seqlens"].long(), TypeError, "cache_seqlens must have dtype int32"),
    ("cache_seqlens", lambda a: [10, 30], TypeError, "cache_seqlens must be a torch.Tensor"),
    ("cache_seqlens", lambda a: a["cache_seqlens"][:1], ValueError, "one entry per batch row"),
    ("cache_seqlens", lambda a: a["cache_seqlens"][None], ValueError, "cache_seqlens must be 1-D"),
    ("block_table", lambda a: a["block_table"].long(), TypeError, "block_table must have dtype int32"),
    ("block_table", lambda a: a["block_table"][0], ValueError, "block_table must be 2-D"),
    ("block_table", lambda a: a["block_table"][:1], ValueError, r"block_table must be \[B, max_pages\]"),
    ("block_table", lambda a: a["block_table"][:, :0], ValueError, r"block_table must be \[B, max_pages\]"),
    ("block_table", lambda a: None, ValueError, "k_cache batch .* must equal q batch"),
    ("sinks", lambda a: torch.zeros(3), ValueError, "sinks must be 1-D of shape"),
    ("window", lambda a: 0, ValueError, "window must be >= 1"),
    ("window", lambda a: 2.5, TypeError, "window must be an int"),
    ("scale", lambda a: "x", TypeError, "scale must be a real number"),
    ("return_lse", lambda a: 1, TypeError, "return_lse must be a bool"),
]


@pytest.mark.boundary
@pytest.mark.parametrize("fn", [flashsink.attention_kvcache, reference.attention_kvcache], ids=["api", "reference"])
@pytest.mark.parametrize("name, change, exc, match", _BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(_BAD)])
def test_validation(fn, name, change, exc, match):
    a = _args()
    a[name] = change(a)
    q, kc, vc, lens = a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("cache_seqlens")
    with pytest.raises(exc, match=match):
        fn(q, kc, vc, lens, **a)


@pytest.mark.boundary
@pytest.mark.parametrize("fn", [flashsink.attention_kvcache, reference.attention_kvcache], ids=["api", "reference"])
def test_values_checked_on_the_host_off_cuda(fn):
    """Lengths in [0, max_pages * page_size], used page indices in [0, num_pages); entries past a
    row's used pages are padding (the fixture's garbage -7 there is accepted)."""
    a = _args()
    q, kc, vc = a.pop("q"), a.pop("k_cache"), a.pop("v_cache")
    lens, table = a["cache_seqlens"], a.pop("block_table")
    cap = table.shape[1] * kc.shape[1]
    assert (table[:, -1] == -7).all()
    fn(q, kc, vc, lens, block_table=table, **{k: v for k, v in a.items() if k != "cache_seqlens"})
    for bad in (cap + 1, -1):
        with pytest.raises(ValueError, match=rf"cache_seqlens\[1\] = {bad} must be in \[0, {cap}\]"):
            fn(q, kc, vc, torch.tensor([10, bad], dtype=torch.int32), block_table=table, layout="bshd")
    for bad in (kc.shape[0], -1):
        t = table.clone()
        t[1, 1] = bad
        with pytest.raises(ValueError, match=rf"block_table\[1, 1\] = {bad} must be a page index in \[0, {kc.shape[0]}\)"):
            fn(q, kc, vc, lens, block_table=t, layout="bshd")
    s_max = 12  # contiguous: lengths up to S_max
    k = torch.randn(2, s_max, HK, D)
    fn(q, k, k, torch.tensor([12, 0], dtype=torch.int32), layout="bshd")
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 13 must be in \[0, 12\] \(S_max"):
        fn(q, k, k, torch.tensor([13, 0], dtype=torch.int32), layout="bshd")


def test_split_count_aims_at_programs_per_sm_with_four_key_tiles_each():
    """``kvcache.n_splits_for``: about ``PROGRAMS_PER_SM`` programs per SM (decode-paged B=8, H_kv=8: 64
    programs a split), capped so that every split has at least four key tiles of the capacity."""
    from types import SimpleNamespace

    from flashsink.kernel_config import Tiles
    from flashsink.ops.launch.kvcache import PROGRAMS_PER_SM, n_splits_for

    tiles = Tiles(64, 128, 128, 2)

    def spec(batch, capacity, seq_q=1):
        return SimpleNamespace(groups=8, seq_q=seq_q, batch=batch, kv_heads=8, capacity=capacity)

    assert PROGRAMS_PER_SM == 8
    assert n_splits_for(spec(8, 65536), tiles, 132) == 17  # ceil(8 * 132 / 64)
    assert n_splits_for(spec(8, 16384), tiles, 132) == 17  # 128 key tiles: the cap (32) does not bind
    assert n_splits_for(spec(8, 4096), tiles, 132) == 8  # 32 key tiles, four each
    assert n_splits_for(spec(8, 300), tiles, 132) == 1  # 3 key tiles
    assert n_splits_for(spec(64, 65536), tiles, 132) == 3  # 512 programs a split: ceil(1056 / 512)
    assert n_splits_for(spec(8, 65536, seq_q=64), tiles, 132) == 3  # 8 row tiles of 64 packed rows
