"""The hand warp-specialized main backward (``ops/kernels/bwd_ws.py``, ``build_bwd(..., ws=True)``) builds
to TIR for Hopper in the configurations tools/bwd_variants.py times, with the launch protocol of
the default kernel; it refuses what it does not support. Lowering only: no nvcc, no GPU (the GPU
check of its gradients is tools/bwd_variants.py's relative L2 against the strict path)."""

import pytest

pytest.importorskip("tilelang")

from flashsink.ops.kernels import bwd  # noqa: E402
from flashsink.ops.build.config import KernelConfig, Tiles  # noqa: E402

pytestmark = pytest.mark.l0


def _cfg(dtype="bfloat16", d=128, layout="bhsd", deterministic=False, precision="fast", arch="sm_90a"):
    return KernelConfig(arch, dtype, d, d, 8, True, True, layout, deterministic, precision)


def _params(func) -> list:
    return [p.name.removesuffix("_handle") for p in func.params]


def _dtypes(func) -> list:
    """The element type of each parameter (a tensor's, or a scalar's own)."""
    return [str(func.buffer_map[p].dtype if p in func.buffer_map else p.dtype) for p in func.params]


@pytest.mark.parametrize("dtype,d,layout,deterministic,tiles,split", [
    ("bfloat16", 128, "bhsd", False, (64, 128, 256, 2), 1),
    ("bfloat16", 128, "bhsd", False, (64, 128, 256, 3), 8),
    ("bfloat16", 64, "bhsd", False, (64, 128, 256, 2), 4),
    ("bfloat16", 64, "bhsd", False, (128, 128, 256, 2), 8),
    ("float16", 128, "bhsd", False, (64, 128, 256, 2), 1),
    ("bfloat16", 128, "bshd", True, (64, 128, 256, 2), 1),
    ("float16", 64, "thd", False, (64, 128, 256, 2), 1),
])
def test_ws_builds_with_the_default_signature(dtype, d, layout, deterministic, tiles, split):
    cfg = _cfg(dtype, d, layout, deterministic)
    func = bwd.build_bwd(cfg, tiles=Tiles(*tiles), split=split, ws=True)
    default = bwd.build_bwd(cfg, split=split, ws=False)  # TileLang's pipelined kernel: the same launch
    assert str(func.attrs["global_symbol"]) == str(default.attrs["global_symbol"])
    assert _params(func) == _params(default)
    assert _dtypes(func) == _dtypes(default)
    # its own syncs replace TileLang's (bwd_ws.py); the register split is set by hand
    assert bool(func.attrs["tilelang_pass_configs"]["tl.disable_thread_storage_sync"])
    text = func.script()
    assert "set_max_nreg" in text and "mbarrier_wait_parity" in text
    assert ("dQAcc" in text) != deterministic


@pytest.mark.parametrize("cfg,tiles", [
    (_cfg(arch="sm_80"), None),
    (_cfg(), Tiles(64, 128, 128, 2)),
])
def test_ws_refuses_what_it_does_not_support(cfg, tiles):
    with pytest.raises(NotImplementedError, match="warp-specialized"):
        bwd.build_bwd(cfg, tiles=tiles, ws=True)


@pytest.mark.parametrize("cfg,want", [
    (_cfg(), True),
    (_cfg("float16", 64, "thd"), True),
    (_cfg(deterministic=True), True),
    (_cfg(precision="strict"), False),
    (_cfg(d=64, precision="strict"), True),
    (_cfg("float16", 64, "thd", deterministic=True, precision="strict"), True),
    (_cfg(d=64, precision="strict", arch="sm_80"), False),
    (_cfg(arch="sm_80"), False),
    (_cfg(d=256), False),
])
def test_library_kernels_are_ws_where_config_says(cfg, want):
    """config.bwd_ws picks the hand kernel for both main-backward kinds (Hopper; fast at D <= 128,
    strict at D64): the library's bwd and bwd_split PrimFuncs are then bwd_ws.py's."""
    from flashsink.ops.build.keys import build_prim_func
    from flashsink.ops.build.config import bwd_split, bwd_ws

    assert bwd_ws(cfg) == want
    for kind in ("bwd",) + (("bwd_split",) if bwd_split(cfg) > 1 else ()):
        text = build_prim_func(kind, cfg).script()
        assert ("set_max_nreg" in text and "mbarrier_wait_parity" in text) == want, kind


@pytest.mark.parametrize("d", [64, 128])
def test_dq_first_order_and_tiles_where_config_says(d):
    """``config.bwd_dq_first``: head dim 64 runs dQ's product before dK's (dQ handed off after one wait)
    with 128-row tiles; D128 keeps 64-row tiles in the old order. Either order is the other's kernel
    with one wait moved (the same launch); deterministic kernels (no dQ) are the same either way."""
    from flashsink.ops.build.config import bwd_dq_first, bwd_tiles

    cfg = _cfg(d=d)
    assert bwd_dq_first(cfg) == (d == 64)
    assert bwd_tiles(cfg) == (Tiles(128, 128, 256, 2) if d == 64 else Tiles(64, 128, 256, 2))
    default = bwd.build_bwd(cfg)
    first, last = bwd.build_bwd(cfg, dq_first=True), bwd.build_bwd(cfg, dq_first=False)
    assert default.script() == (first if d == 64 else last).script() and first.script() != last.script()
    assert _params(first) == _params(last) and _dtypes(first) == _dtypes(last)
    # one wait more: dQ's product alone (dK's still running), then both
    assert first.script().count("T.wait_wgmma(1)") == last.script().count("T.wait_wgmma(1)") + 1
    det = _cfg(d=d, deterministic=True)
    assert bwd.build_bwd(det, dq_first=True).script() == bwd.build_bwd(det, dq_first=False).script()
    # strict (the hand kernel's two-term products at D64, TileLang's kernel at D128) keeps 64-row tiles
    # in the old order; so do packed batches and full attention (ptxas spills the 128-row kernel there)
    for other in (_cfg(d=d, precision="strict"), _cfg(d=d, layout="thd"),
                  KernelConfig("sm_90a", "bfloat16", d, d, 8, False, True, "bhsd", False, "fast")):
        assert bwd_tiles(other) == Tiles(64, 128, 256, 2) and not bwd_dq_first(other)
    assert bwd_dq_first(_cfg("float16", d, "bshd", deterministic=True)) == (d == 64)


def test_strict_preprocess_branches_and_goes_longest_first_on_hopper():
    """``config.pre_branch`` / ``pre_lpt``: Hopper's strict preprocess skips the mask on wholly visible KV
    tiles and issues its query tiles longest first (padded layouts); sm_80 and the fast preprocess do not."""
    from flashsink.ops.build.keys import build_prim_func
    from flashsink.ops.build.config import pre_branch, pre_lpt, pre_tiles

    strict = _cfg(precision="strict")
    assert pre_branch(strict) and pre_lpt(strict)
    thd16 = _cfg("float16", 64, "thd", precision="strict")
    assert pre_branch(thd16) and not pre_lpt(thd16)
    assert not pre_branch(_cfg(precision="strict", arch="sm_80")) and not pre_branch(_cfg())
    lib = build_prim_func("preprocess", strict).script()
    assert lib == bwd.build_preprocess(strict, branch=True, lpt=True).script()
    assert lib != bwd.build_preprocess(strict, branch=False, lpt=False).script()
    old = _cfg(precision="strict", arch="sm_80")
    assert build_prim_func("preprocess", old).script() == bwd.build_preprocess(old, branch=False, lpt=False).script()
    thd = _cfg(layout="thd", precision="strict")
    assert build_prim_func("preprocess", thd).script() == bwd.build_preprocess(thd, branch=True, lpt=False).script()
    # other tiles (tools/bwd_variants.py's "strict pre/... 64x128/s2"): the same launch, another kernel
    other = bwd.build_preprocess(strict, tiles=Tiles(64, 128, 256, 2))
    assert _params(other) == _params(build_prim_func("preprocess", strict)) and other.script() != lib
    assert bwd.build_preprocess(strict, tiles=pre_tiles(strict)).script() == lib
    with pytest.raises(ValueError, match="strict preprocess"):
        bwd.build_preprocess(_cfg(), tiles=Tiles(64, 128, 256, 2))


@pytest.mark.parametrize("d", [64, 128])
def test_ws_strict_option_has_two_term_products(d):
    """``build_bwd(ws=True)`` with precision="strict" (strict's default at D64, ``config.bwd_ws``; an
    option of tools/bwd_variants.py at D128): the launch of TileLang's strict kernel, its P^T and dS^T
    split into hi + lo (split.py), so three products more per tile than the fast kernel (dV, dK, dQ
    each twice)."""
    from flashsink.ops.build.keys import build_prim_func

    strict, fast = _cfg(d=d, precision="strict"), _cfg(d=d)
    t = Tiles(64, 128, 256, 2)
    func = bwd.build_bwd(strict, tiles=t, ws=True, dq_first=False)
    pipelined = bwd.build_bwd(strict, ws=False)
    assert _params(func) == _params(pipelined) and _dtypes(func) == _dtypes(pipelined)
    text, fast_text = func.script(), bwd.build_bwd(fast, tiles=t, ws=True, dq_first=False).script()
    assert text.count("wgmma_gemm") == fast_text.count("wgmma_gemm") + 3
    # the library's: this kernel at D64, TileLang's at D128 (the two-term kernel measured slower there)
    assert (build_prim_func("bwd", strict).script() == text) == (d == 64)
    assert "set_max_nreg" not in pipelined.script()


def test_strict_preprocess_from_an_fp32_o_option():
    """``build_preprocess(o32=True)`` (strict; the kind ``preprocess_o32``, tools/bwd_variants.py's
    "strict pre/o32"): the fast preprocess's memory-bound pass with O in fp32 (the forward's ``o32`` output);
    the fast kernel's launch otherwise; it refuses the fast configuration and the P-pass options."""
    from flashsink.ops.build.keys import build_prim_func

    for d, layout in ((64, "bhsd"), (128, "thd")):
        strict = _cfg(d=d, layout=layout, precision="strict")
        fast = build_prim_func("preprocess", _cfg(d=d, layout=layout))
        func = bwd.build_preprocess(strict, o32=True)
        assert _params(func) == _params(fast)
        assert _dtypes(func) == ["float32"] + _dtypes(fast)[1:] and _dtypes(fast)[0] == "bfloat16"
    with pytest.raises(ValueError, match="o32"):
        bwd.build_preprocess(_cfg(), o32=True)
    with pytest.raises(ValueError, match="o32"):
        bwd.build_preprocess(_cfg(precision="strict"), o32=True, tiles=Tiles(64, 128, 256, 2))


@pytest.mark.parametrize("precision,d,tiles,dq_first", [
    ("fast", 128, (64, 128, 256, 2), False),  # golden's kernel
    ("fast", 64, (128, 128, 256, 2), True),  # D64's, dQ first
    ("strict", 64, (64, 128, 256, 2), False),  # strict's two-term products
])
def test_skip_halves_option(precision, d, tiles, dq_first):
    """``build_bwd(skip_halves=True)`` (tools/bwd_variants.py's ".../skip", to be measured): each consumer
    computes the row blocks its half of the keys sees (``row_blocks_for_keys`` from ``key0 + wg * bn / 2``)
    and, outside them, issues no S^T, dP^T, dV or dK product, only zeros for its part of dS^T; the dQ
    product and the slot's release stay unconditional (both consumers meet once per tile). Off, the
    kernel is the one built without the option, TIR for TIR."""
    cfg = _cfg("float16" if d == 128 else "bfloat16", d, precision=precision)
    kw = dict(tiles=Tiles(*tiles), ws=True, dq_first=dq_first)
    plain = bwd.build_bwd(cfg, **kw)
    assert plain.script() == bwd.build_bwd(cfg, **kw, skip_halves=False).script()
    func = bwd.build_bwd(cfg, **kw, skip_halves=True)
    assert _params(func) == _params(plain) and _dtypes(func) == _dtypes(plain)
    text = func.script()
    assert "own_lo" not in plain.script()
    assert "live: T.bool = T.bitwise_and(lo_blk[0] + it % n_rows >= own_lo[0], lo_blk[0] + it % n_rows < own_hi[0])" in text
    # the block's products and softmax (else: the zeros), and dK's product
    assert sum(ln.strip() == "if live:" for ln in text.splitlines()) == 2
    assert text.count("T.wgmma_gemm") == plain.script().count("T.wgmma_gemm")
    assert text.count("T.barrier_arrive(empty[") == plain.script().count("T.barrier_arrive(empty[")


def test_skip_halves_is_for_the_ws_kernel():
    with pytest.raises(ValueError, match="skip_halves"):
        bwd.build_bwd(_cfg(precision="strict"), ws=False, skip_halves=True)


@pytest.mark.parametrize("precision", ["fast", "strict"])
def test_packed_batches_stage_lse_and_delta(precision):
    """A packed batch's (thd) lse and Delta rows reach the consumers through the ring, as the padded
    layouts' do: the producer's 128 threads copy a tile's rows with plain loads (a packed row need not
    start 16-byte aligned for the bulk copy) before the slot's arrival, and P^T and dS^T read shared
    memory instead of one global load per element."""
    cfg = _cfg("bfloat16", 64, "thd", precision=precision)
    text = bwd.build_bwd(cfg, tiles=Tiles(64, 128, 256, 2), ws=True).script()
    assert text.count("LSE[") == 1 and "lse_r[s, i] = LSE[head, row + i]" in text
    assert text.count("Delta[") == 1 and "delta_r[s, i - 64] = Delta[head, row + i - 64]" in text
    assert "lse_r[s, j]" in text and "delta_r[s, j]" in text
    lines = [ln.strip() for ln in text.splitlines()]
    staged = lines.index("lse_r[s, i] = LSE[head, row + i]")
    arrive = next(i for i in range(staged, len(lines)) if lines[i].startswith("T.ptx_arrive_barrier(full_1["))
    assert arrive - staged < 6  # the slot's arrival follows the staging


@pytest.mark.parametrize("d", [64, 128])
def test_prefetch_sdp_option(d):
    """``build_bwd(prefetch="sdp")`` (tools/bwd_variants.py's ".../prefetch", to be measured): the first
    row block's S^T and dP^T are issued before the loop into a second pair of accumulators; each block
    waits for them, copies them, waits for the next block's slot and issues its S^T and dP^T before
    its own softmax. The slot wait moves out of the loop's head. Off, the kernel is the one built without
    the option, TIR for TIR."""
    cfg = _cfg("float16" if d == 128 else "bfloat16", d)
    kw = dict(tiles=Tiles(64, 128, 256, 3), ws=True, dq_first=False)
    plain = bwd.build_bwd(cfg, **kw)
    assert plain.script() == bwd.build_bwd(cfg, **kw, prefetch="").script()
    func = bwd.build_bwd(cfg, **kw, prefetch="sdp")
    assert _params(func) == _params(plain) and _dtypes(func) == _dtypes(plain)
    text = func.script()
    assert "pT_next" not in plain.script()
    assert "pT_next = T.sblock_alloc_buffer" in text and "dpT_next = T.sblock_alloc_buffer" in text
    lines = [ln.strip() for ln in text.splitlines()]
    assert "if it + 1 < n_it:" in lines
    # each of the two accumulators: the prologue's product, the loop's product and the copy out
    assert text.count("T.region(pT_next[0, 0]") == 3 and text.count("T.region(dpT_next[0, 0]") == 3
    assert text.count("T.wgmma_gemm") == plain.script().count("T.wgmma_gemm") + 2
    assert text.count("T.mbarrier_wait_parity(full_1[") == plain.script().count("T.mbarrier_wait_parity(full_1[") + 1


def test_prefetch_refusals():
    with pytest.raises(ValueError, match="prefetch"):
        bwd.build_bwd(_cfg(), tiles=Tiles(64, 128, 256, 3), ws=True, skip_halves=True, prefetch="sdp")
    with pytest.raises(ValueError, match="prefetch"):
        bwd.build_bwd(_cfg(precision="strict"), ws=False, prefetch="sdp")


def test_prefetch_s_option():
    """``build_bwd(prefetch="s")`` (".../prefetch-s"): only the next block's S^T is issued ahead (one more
    accumulator, where "sdp"'s two spill at D128); this block's dP^T is issued at its start, before
    the next S^T, and waited for with one group (the next S^T) still in flight."""
    cfg = _cfg("float16", 128)
    kw = dict(tiles=Tiles(64, 128, 256, 3), ws=True, dq_first=False)
    plain = bwd.build_bwd(cfg, **kw).script()
    text = bwd.build_bwd(cfg, **kw, prefetch="s").script()
    assert "pT_next = T.sblock_alloc_buffer" in text and "dpT_next" not in text
    assert text.count("T.wgmma_gemm") == plain.count("T.wgmma_gemm") + 1
    assert "T.wait_wgmma(1)" in text
    with pytest.raises(ValueError, match="prefetch must be"):
        bwd.build_bwd(cfg, **kw, prefetch="dp")


@pytest.mark.parametrize("d, tiles, dq_first", [(128, (64, 128, 256, 2), False), (64, (128, 128, 256, 2), True)])
def test_dq_cast_option(d, tiles, dq_first):
    """``build_bwd(dq_cast=True)`` (tools/bwd_variants.py's ".../dqcast", to be measured): two more
    parameters, dQ (q's dtype) and DqCount (int32); the producer's first warp loads the ring alone
    (its slots' barriers count 32 arrivals), its second warp adds dQ, waits for the add before the one
    just issued (``tma_store_wait(1, read=False)``; the last tile's with 0), counts it with an acq_rel
    atomic that returns the old count, and casts the row block where the count reaches the KV tiles
    that see it. Off, the kernel is the one built without the option, TIR for TIR."""
    cfg = _cfg("float16" if d == 128 else "bfloat16", d)
    kw = dict(tiles=Tiles(*tiles), ws=True, dq_first=dq_first)
    plain = bwd.build_bwd(cfg, **kw)
    assert plain.script() == bwd.build_bwd(cfg, **kw, dq_cast=False).script()
    func = bwd.build_bwd(cfg, **kw, dq_cast=True)
    assert _params(func) == _params(plain) + ["dQ", "DqCount"]
    assert _dtypes(func) == _dtypes(plain) + [cfg.dtype, "int32"]
    text = func.script()
    lines = [ln.strip() for ln in text.splitlines()]
    assert "full: [32, 32]" in text and "dq_empty: [32]" in text and "cast_full: [32]" in text  # the dQ warp arrives whole
    assert "loads_here: T.bool = tx < 288" in lines and "if tx >= 288 and tx < 320:" in lines
    assert lines.count("T.tma_store_wait(1, T.bool(False))") == 1 and lines.count("T.tma_store_wait(0, T.bool(False))") == 1
    counts = [ln for ln in lines if "T.atomic_add_ret_elem_op(T.access_ptr(DqCount[" in ln]
    assert len(counts) == 2 and all(", 1, 4) + 1 == seen_by" in ln for ln in counts)  # memory order 4: acq_rel
    assert sum("= T.Cast(" in ln and ln.startswith("dQ[") for ln in lines) == 2
    assert "DqCount" not in plain.script() and "cast_s" not in plain.script()


def test_dq_cast_refusals():
    with pytest.raises(ValueError, match="dq_cast"):
        bwd.build_bwd(_cfg(), ws=False, dq_cast=True)
    for cfg, split in ((_cfg(precision="strict", d=64), 1), (_cfg(layout="thd"), 1), (_cfg(deterministic=True), 1),
                       (_cfg(), 2)):
        with pytest.raises(NotImplementedError, match="dq_cast supports"):
            bwd.build_bwd(cfg, ws=True, split=split, dq_cast=True)


def test_dq_cast_follows_the_config(monkeypatch):
    """``build_bwd``'s default ``dq_cast`` is ``config.bwd_dq_cast``: off (DQ_CAST) until measured; on, the
    unsplit fast kernel casts dQ (its two more parameters) and the split, strict and thd kernels do not."""
    from flashsink.ops.build import config

    cfg = _cfg("float16", 128)
    assert not config.bwd_dq_cast(cfg) and "DqCount" not in _params(bwd.build_bwd(cfg))
    monkeypatch.setattr(config, "DQ_CAST", True)
    assert _params(bwd.build_bwd(cfg))[-2:] == ["dQ", "DqCount"]
    assert "DqCount" not in _params(bwd.build_bwd_split(cfg))
    for other in (_cfg(d=64, precision="strict"), _cfg(layout="thd"), _cfg(deterministic=True)):
        assert not config.bwd_dq_cast(other) and "DqCount" not in _params(bwd.build_bwd(other))
