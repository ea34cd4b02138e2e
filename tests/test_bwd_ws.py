"""The hand warp-specialized main backward (``ops/kernels/bwd_ws.py``, ``build_bwd_ws``) builds
to TIR for Hopper in the configurations lab/bwd_variants.py times, with the launch protocol of
TileLang's kernel (``bwd.build_bwd_pipelined``); it refuses what it does not support. Lowering only: no nvcc, no GPU (the GPU
check of its gradients is lab/bwd_variants.py's relative L2 against the strict path)."""

import pytest

pytest.importorskip("tilelang")

from flashsink.ops.kernels import bwd, bwd_ws  # noqa: E402
from flashsink import kernel_config as config  # noqa: E402
from flashsink.kernel_config import KernelConfig, Tiles  # noqa: E402

pytestmark = pytest.mark.l0


def _cfg(dtype="bfloat16", d=128, layout="bhsd", deterministic=False, precision="fast", arch="sm_90a"):
    return KernelConfig(arch, dtype, d, d, 8, True, True, layout, deterministic, precision)


def _ws(cfg, tiles=None, split=1, dq_first=False, ds_first=False):
    """The hand kernel (``bwd_ws.build_bwd_ws``), tiles ``config.bwd_tiles`` by default."""
    return bwd_ws.build_bwd_ws(cfg, tiles or config.bwd_tiles(cfg), split, dq_first, ds_first)


def _pipelined(cfg, split=1):
    """TileLang's kernel with the config's choices (what ``build_bwd`` builds where not ``config.bwd_ws``)."""
    return bwd.build_bwd_pipelined(cfg, config.bwd_tiles(cfg), split, config.bwd_branch(cfg), config.bwd_swap(cfg),
                                   config.bwd_dq_bulk(cfg), config.bwd_overlap(cfg))


def _pre_strict(cfg, branch, lpt, tiles=None):
    return bwd.build_preprocess_strict(cfg, tiles or config.pre_tiles(cfg), branch, lpt)


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
    func = _ws(cfg, Tiles(*tiles), split)
    default = _pipelined(cfg, split)  # TileLang's pipelined kernel: the same launch
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
        _ws(cfg, tiles)


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
    from flashsink.ops.compiler.compile import build_prim_func
    from flashsink.kernel_config import bwd_split, bwd_ws

    assert bwd_ws(cfg) == want
    for kind in ("bwd",) + (("bwd_split",) if bwd_split(cfg) > 1 else ()):
        text = build_prim_func(kind, cfg).script()
        assert ("set_max_nreg" in text and "mbarrier_wait_parity" in text) == want, kind


@pytest.mark.parametrize("d", [64, 128])
def test_dq_first_order_and_tiles_where_config_says(d):
    """``config.bwd_dq_first``: head dim 64 runs dQ's product before dK's (dQ handed off after one wait)
    with 128-row tiles; D128 keeps 64-row tiles in the old order. Either order is the other's kernel
    with one wait moved (the same launch); deterministic kernels (no dQ) are the same either way."""
    from flashsink.kernel_config import bwd_dq_first, bwd_tiles

    cfg = _cfg(d=d)
    assert bwd_dq_first(cfg) == (d == 64)
    assert bwd_tiles(cfg) == (Tiles(128, 128, 256, 2) if d == 64 else Tiles(64, 128, 256, 2))
    default = bwd.build_bwd(cfg)
    first, last = _ws(cfg, dq_first=True), _ws(cfg, dq_first=False)
    assert default.script() == (first if d == 64 else last).script()
    assert first.script() != last.script()
    assert _params(first) == _params(last) and _dtypes(first) == _dtypes(last)
    # one wait more: dQ's product alone (dK's still running), then both
    assert first.script().count("T.wait_wgmma(1)") == last.script().count("T.wait_wgmma(1)") + 1
    det = _cfg(d=d, deterministic=True)
    assert _ws(det, dq_first=True).script() == _ws(det, dq_first=False).script()
    # strict (the hand kernel's two-term products at D64, TileLang's kernel at D128) keeps 64-row tiles
    # in the old order; so do packed batches and full attention (ptxas spills the 128-row kernel there)
    for other in (_cfg(d=d, precision="strict"), _cfg(d=d, layout="thd"),
                  KernelConfig("sm_90a", "bfloat16", d, d, 8, False, True, "bhsd", False, "fast")):
        assert bwd_tiles(other) == Tiles(64, 128, 256, 2) and not bwd_dq_first(other)
    assert bwd_dq_first(_cfg("float16", d, "bshd", deterministic=True)) == (d == 64)


@pytest.mark.parametrize("precision", ["fast", "strict"])
def test_ds_first_reorders_the_same_statements(precision):
    """``build_bwd_ws(ds_first=True)`` (for D64's dq-first 128-row kernel, whose wgmma ptxas serializes in
    the old order, tests/test_ptxas.py; no default uses it until it is timed on a GPU, perf-log v33): dS^T
    written into dP^T's registers instead of P^T's, P^T and dS^T rounded, then dV's product issued. The same
    statements otherwise (the same products, roundings and selects: the math is the old order's)."""
    assert bwd.build_bwd(_cfg(d=64)).script() == _ws(_cfg(d=64), dq_first=True).script()
    cfg = _cfg(d=64, precision=precision)
    old = _ws(cfg, dq_first=True).script().splitlines()
    new = _ws(cfg, dq_first=True, ds_first=True).script().splitlines()
    assert new != old
    def as_old(line):
        """``line`` of the new order with dS^T back in P^T's registers: its two loops (a wholly visible tile,
        a masked one) write, and its rounding (strict: hi and lo) reads, dP^T there."""
        if line.strip().startswith("dpT[i, j] = "):
            return line.replace("dpT[i, j] = ", "pT[i, j] = ", 1)
        if line.strip().startswith("ds_l[i, j] = ") or "T.region(ds_h[0, 0], 2" in line:
            return line.replace("dpT[", "pT[")
        return line

    assert sum(line.strip().startswith("dpT[i, j] = ") for line in new) == 2
    assert sorted(map(as_old, new)) == sorted(old)

    def dv_after_ds(lines):
        dv = next(i for i, line in enumerate(lines) if "T.wgmma_gemm(T.region(p_h[0, 0]" in line)
        ds = next(i for i, line in enumerate(lines) if "ds_h[0, 0], 2" in line)  # dS^T's rounding
        return dv > ds

    assert dv_after_ds(new) and not dv_after_ds(old)


def test_dk_in_flight_leaves_dk_running_into_the_next_tile():
    """``build_bwd_ws(dk_in_flight=True)`` (FlashAttention-3's order, timed by lab/bwd_variants.py's /dkflight
    rows; no default uses it, perf-log v34): the tile no longer ends by waiting for every product and releasing
    its ring slot; the slot of tile it-1 is released once tile it's S^T is waited for (which retires tile it-1's
    dK, issued before it), and the last dK is waited for after the loop, before dK is added out."""
    cfg = _cfg(d=128)
    t = config.bwd_tiles(cfg)
    old = bwd_ws.build_bwd_ws(cfg, t, 8, True, True, head_major=True).script().splitlines()
    new = bwd_ws.build_bwd_ws(cfg, t, 8, True, True, head_major=True, dk_in_flight=True).script().splitlines()
    strip = [line.strip() for line in new]
    assert "T.ptx_arrive_barrier(empty_1[s])" in [line.strip() for line in old]
    assert "T.ptx_arrive_barrier(empty_1[s])" not in strip
    released = strip.index("T.ptx_arrive_barrier(empty_1[(it - 1) % 2])")
    assert strip[released - 2:released] == ["T.wait_wgmma(1)", "if it > 0:"]
    # one wait for every product left: after the loop (indented less than the loop's body), before dK's adds
    waits = [i for i, line in enumerate(strip) if line == "T.wait_wgmma(0)"]
    last = waits[-1]
    assert len(new[last]) - len(strip[last]) < len(new[released]) - len(strip[released])
    assert strip[last + 1].startswith("T.atomicadd(T.region(dk[")
    assert len(waits) == sum(line == "T.wait_wgmma(0)" for line in (s.strip() for s in old))
    with pytest.raises(NotImplementedError, match="dk_in_flight needs dq_first"):
        bwd_ws.build_bwd_ws(cfg, t, 8, False, True, head_major=True, dk_in_flight=True)


@pytest.mark.parametrize("d", [128, 64])
def test_tma_epilogue_adds_dk_dv_by_bulk_reduce(d):
    """``build_bwd_ws(tma_epilogue=True)`` (the split kernel's dK/dV by bulk reduce-adds from shared memory,
    FlashAttention-4's epilogue; lab/bwd_variants.py's /tmaepi rows, perf-log v36): the same kernel up to the
    last wait, one fp32 [bn, dim / 2] staging tile more, and in place of the two per-thread atomic adds four
    bulk adds (dK's and dV's column halves, in that order), only where the program saw a row; unsplit, refused."""
    cfg = _cfg(d=d)
    t = config.bwd_tiles(cfg)
    fa3 = dict(dq_first=True, ds_first=True, head_major=True, dk_in_flight=True)  # FlashAttention-3's order
    old = bwd_ws.build_bwd_ws(cfg, t, 8, **fa3).script().splitlines()
    new = bwd_ws.build_bwd_ws(cfg, t, 8, **fa3, tma_epilogue=True).script().splitlines()
    last = max(i for i, line in enumerate(old) if line.strip() == "T.wait_wgmma(0)")
    stage = [line for line in new if "kv_stage = T.sblock_alloc_buffer" in line]
    assert [line.strip() for line in stage] == [f'kv_stage = T.sblock_alloc_buffer(({t.block_n}, {d // 2}), scope="shared.dyn")']
    assert [line for line in new if line not in stage][: last + 1] == old[: last + 1]
    assert [line.strip() for line in old[last + 1 :] if "T.atomicadd" in line] == [
        f"T.atomicadd(T.region({acc}[0, 0], 1, {t.block_n}, {d}), T.region({grad}[by, kv_head, key0, 0], 2, 1, 1, {t.block_n}, {d}))"
        for acc, grad in (("dk", "dK"), ("dv", "dV"))]
    tail = [line.strip() for line in new[last + 3 :]]  # (new has the stage's line more, before the loop)
    assert new[last + 2].strip() == "if n_it > 0:"
    adds = [line for line in tail if line.startswith("T.atomicadd")]
    assert adds == [f"T.atomicadd(T.region(kv_stage[0, 0], 1, {t.block_n}, {d // 2}), T.region({grad}[by, kv_head, key0, "
                    f"{c0}], 2, 1, 1, {t.block_n}, {d // 2}), use_tma=1)" for grad in ("dK", "dV") for c0 in (0, d // 2)]
    copies = [line for line in tail if line.startswith("T.copy")]
    assert copies == [f"T.copy(T.region({acc}[0, {c0}], 1, {t.block_n}, {d // 2}), T.region(kv_stage[0, 0], 2, {t.block_n}, "
                      f"{d // 2}))" for acc in ("dk", "dv") for c0 in (0, d // 2)]
    # each write of the stage after the first waits at the consumers' barrier for the add before it
    for i, line in enumerate(tail):
        if line.startswith("T.copy") and line != copies[0]:
            assert tail[i - 1] == 'T.tvm_storage_sync("shared", 1, 256)'
    with pytest.raises(NotImplementedError, match="tma_epilogue is the split kernel's"):
        bwd_ws.build_bwd_ws(cfg, t, 1, True, True, tma_epilogue=True)


def test_strict_preprocess_branches_and_goes_longest_first_on_hopper():
    """``config.pre_branch`` / ``pre_lpt``: Hopper's strict preprocess skips the mask on wholly visible KV
    tiles and issues its query tiles longest first (padded layouts); sm_80 and the fast preprocess do not."""
    from flashsink.ops.compiler.compile import build_prim_func
    from flashsink.kernel_config import pre_branch, pre_lpt, pre_tiles

    strict = _cfg(precision="strict")
    assert pre_branch(strict) and pre_lpt(strict)
    thd16 = _cfg("float16", 64, "thd", precision="strict")
    assert pre_branch(thd16) and not pre_lpt(thd16)
    assert not pre_branch(_cfg(precision="strict", arch="sm_80")) and not pre_branch(_cfg())
    lib = build_prim_func("preprocess", strict).script()
    assert lib == _pre_strict(strict, True, True).script()
    assert lib != _pre_strict(strict, False, False).script()
    old = _cfg(precision="strict", arch="sm_80")
    assert build_prim_func("preprocess", old).script() == _pre_strict(old, False, False).script()
    thd = _cfg(layout="thd", precision="strict")
    assert build_prim_func("preprocess", thd).script() == _pre_strict(thd, True, False).script()
    # other tiles (lab/bwd_variants.py's "strict pre/... 64x128/s2"): the same launch, another kernel
    other = _pre_strict(strict, True, True, Tiles(64, 128, 256, 2))
    assert _params(other) == _params(build_prim_func("preprocess", strict)) and other.script() != lib
    assert _pre_strict(strict, True, True, pre_tiles(strict)).script() == lib
    with pytest.raises(ValueError, match="padded layout"):
        _pre_strict(thd, True, True)


@pytest.mark.parametrize("d", [64, 128])
def test_ws_strict_option_has_two_term_products(d):
    """``build_bwd_ws`` with precision="strict" (strict's default at D64, ``config.bwd_ws``; a row of
    lab/bwd_variants.py at D128): the launch of TileLang's strict kernel, its P^T and dS^T
    split into hi + lo (split.py), so three products more per tile than the fast kernel (dV, dK, dQ
    each twice)."""
    from flashsink.ops.compiler.compile import build_prim_func

    strict, fast = _cfg(d=d, precision="strict"), _cfg(d=d)
    t = Tiles(64, 128, 256, 2)
    func = _ws(strict, t)
    pipelined = _pipelined(strict)
    assert _params(func) == _params(pipelined) and _dtypes(func) == _dtypes(pipelined)
    text, fast_text = func.script(), _ws(fast, t).script()
    assert text.count("wgmma_gemm") == fast_text.count("wgmma_gemm") + 3
    # the library's: this kernel at D64, TileLang's at D128 (the two-term kernel measured slower there)
    assert (build_prim_func("bwd", strict).script() == text) == (d == 64)
    assert "set_max_nreg" not in pipelined.script()


def test_strict_preprocess_from_an_fp32_o_option():
    """``build_preprocess_o32`` (strict; the kind ``preprocess_o32``, lab/bwd_variants.py's
    "strict pre/o32"): the fast preprocess's memory-bound pass with O in fp32 (the forward's ``o32`` output);
    the fast kernel's launch otherwise; it refuses the fast configuration."""
    from flashsink.ops.compiler.compile import build_prim_func

    for d, layout in ((64, "bhsd"), (128, "thd")):
        strict = _cfg(d=d, layout=layout, precision="strict")
        fast = build_prim_func("preprocess", _cfg(d=d, layout=layout))
        func = bwd.build_preprocess_o32(strict)
        assert _params(func) == _params(fast)
        assert _dtypes(func) == ["float32"] + _dtypes(fast)[1:] and _dtypes(fast)[0] == "bfloat16"
    with pytest.raises(ValueError, match="o32"):
        bwd.build_preprocess_o32(_cfg())


@pytest.mark.parametrize("precision", ["fast", "strict"])
def test_packed_batches_stage_lse_and_delta(precision):
    """A packed batch's (thd) lse and Delta rows reach the consumers through the ring, as the padded
    layouts' do: the producer's 128 threads copy a tile's rows with plain loads (a packed row need not
    start 16-byte aligned for the bulk copy) before the slot's arrival, and P^T and dS^T read shared
    memory instead of one global load per element."""
    cfg = _cfg("bfloat16", 64, "thd", precision=precision)
    text = _ws(cfg, Tiles(64, 128, 256, 2)).script()
    assert text.count("LSE[") == 1 and "lse_r[s, i] = LSE[head, row + i]" in text
    assert text.count("Delta[") == 1 and "delta_r[s, i - 64] = Delta[head, row + i - 64]" in text
    assert "lse_r[s, j]" in text and "delta_r[s, j]" in text
    lines = [ln.strip() for ln in text.splitlines()]
    staged = lines.index("lse_r[s, i] = LSE[head, row + i]")
    arrive = next(i for i in range(staged, len(lines)) if lines[i].startswith("T.ptx_arrive_barrier(full_1["))
    assert arrive - staged < 6  # the slot's arrival follows the staging
