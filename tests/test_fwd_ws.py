"""The hand warp-specialized forward (``ops/kernels/fwd_ws.py``, ``build_fwd_ws``) builds to TIR for
Hopper in the configurations lab/fwd_variants.py times, with the launch protocol of the pipelined
forward; it refuses what it does not support. Lowering only, plus one nvcc compile (the GPU check of
its o and lse is lab/fwd_variants.py's, against the pipelined kernel, and the GPU suite's wherever
``config.fwd_ws`` makes it the library's forward)."""

import shutil

import pytest

pytest.importorskip("tilelang")

from flashsink.ops.kernels import fwd  # noqa: E402
from flashsink.kernel_config import FWD_WINDOW_ROWS_D64, KernelConfig, Tiles, fwd_fold, fwd_tiles, fwd_ws_options  # noqa: E402
from flashsink.ops.kernels.fwd_ws import build_fwd_ws, consumer_regs  # noqa: E402

pytestmark = pytest.mark.l0


def _cfg(dtype="bfloat16", d=128, layout="bhsd", causal=True, sinks=True, arch="sm_90a", groups=8):
    return KernelConfig(arch, dtype, d, d, groups, causal, sinks, layout, deterministic=False, precision="strict")


def _params(func) -> list:
    return [p.name.removesuffix("_handle") for p in func.params]


def _ws(cfg, tiles=None, fold=None):
    """fwd_ws.py's kernel with the library's options at ``tiles`` (default the forward's)."""
    t = tiles or fwd_tiles(cfg)
    return build_fwd_ws(cfg, t, fold=fwd_fold(cfg) if fold is None else fold, **fwd_ws_options(cfg, t))


def _dtypes(func) -> list:
    return [str(func.buffer_map[p].dtype if p in func.buffer_map else p.dtype) for p in func.params]


@pytest.mark.parametrize("cfg,tiles", [
    (_cfg(), Tiles(128, 128, 256, 2)),
    (_cfg("float16", 128, causal=False), Tiles(128, 64, 256, 2)),
    (_cfg(d=64), Tiles(128, 128, 256, 3)),
    (_cfg(d=64, sinks=False), Tiles(192, 128, 384, 2)),
    (_cfg("float16", 64, "bshd"), Tiles(128, 128, 256, 2)),
    (_cfg(d=64, layout="thd", groups=1), Tiles(128, 128, 256, 2)),
])
def test_ws_builds_with_the_default_signature(cfg, tiles):
    func = _ws(cfg, tiles)
    default = fwd.build_fwd_pipelined(cfg)  # TileLang's pipelined kernel: the same launch
    assert str(func.attrs["global_symbol"]) == str(default.attrs["global_symbol"])
    assert _params(func) == _params(default)
    assert _dtypes(func) == _dtypes(default)
    assert bool(func.attrs["tilelang_pass_configs"]["tl.disable_thread_storage_sync"])
    text = func.script()
    assert "set_max_nreg" in text and "mbarrier_wait_parity" in text and "wait_wgmma" in text
    # one producer warpgroup beside one consumer warpgroup per 64 query rows
    assert f'"tl.launch_threads": [{tiles.block_m * 2 + 128}, 1, 1]' in text
    # S for the first tile and in the loop, PV in the loop and for the last tile; only PV's wait lags
    assert text.count("T.wgmma_gemm(") == 4 and text.count("T.wait_wgmma(1)") == 1
    assert "kb >= flo" in text  # the per-element mask skipped on wholly visible tiles


@pytest.mark.parametrize("cfg,tiles,opts", [
    (_cfg(arch="sm_80"), None, {}),
    (_cfg(), Tiles(96, 128, 256, 2), {}),
    (_cfg(), Tiles(128, 128, 256, 0), {}),
])
def test_ws_refuses_what_it_does_not_support(cfg, tiles, opts):
    with pytest.raises(NotImplementedError, match="warp-specialized"):
        _ws(cfg, tiles, **opts)


@pytest.mark.parametrize("d", [64, 128])
def test_fold_is_the_default_and_fwd_unfolded_the_other(d):
    """config.fwd_fold: the library's forward folds the scale (positive scales); the kind
    fwd_unfolded is the same kernel scaling each logit first (scale <= 0)."""
    from flashsink.ops.compiler.compile import build_prim_func
    from flashsink.kernel_config import fwd_fold

    cfg = _cfg(d=d)
    assert fwd_fold(cfg)
    lib, unfolded = build_prim_func("fwd", cfg).script(), build_prim_func("fwd_unfolded", cfg).script()
    assert lib == _ws(cfg, fold=True).script()
    assert unfolded == _ws(cfg, fold=False).script() != lib


def test_consumer_registers_fit_the_register_file():
    for n in (1, 2, 3, 4):
        regs = consumer_regs(n)
        assert regs % 8 == 0 and regs <= 240
        assert 128 * n * regs + 128 * 24 <= 65536
    assert consumer_regs(2) == 240 and consumer_regs(3) == 160


@pytest.mark.parametrize("d, layout", [(64, "bshd"), (128, "bhsd")])
def test_tma_epilogue_stores_each_warpgroups_rows_by_tma(d, layout):
    """build_fwd_ws(epilogue="tma"): the staged rows (swizzled, as "wg") stored by TMA in boxes of 8 rows and 64
    columns from one thread of each consumer warpgroup (a packed tile's rows change head every ``pack`` rows),
    after a proxy fence and the warpgroup's barrier; the issuing thread waits for its stores to have read the
    buffer before the next tile writes it and before the program exits. Refused where a box could write past
    a sequence into the next one (thd), and with o32."""
    from flashsink.kernel_config import fwd_window_tiles
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    cfg = _cfg("bfloat16" if d == 64 else "float16", d, layout)
    t = fwd_window_tiles(cfg)
    kw = dict(fold=True, q_slots=2, pack_gqa=True)
    tma = build_fwd_ws(cfg, t, epilogue="tma", **kw).script()
    wg = build_fwd_ws(cfg, t, epilogue="wg", **kw).script()
    pack = t.block_m // cfg.groups
    store = [line.strip() for line in tma.splitlines() if "T.tma_copy(" in line and "o_s" in line]
    assert len(store) == 1 and "leader_scope_threads=128" in store[0]
    assert f"T.region(o_s_1[r, hc * 64], 1, 8, 64)" in store[0] and f"r // {pack}" in store[0]
    assert tma.count("T.fence_proxy_async()") == 1 and tma.count("T.tma_store_wait(0") == 2
    assert "store_rows_vec" not in tma and tma.count("T.tma_copy(") == wg.count("T.tma_copy(") + 1
    for bad in (dict(cfg=_cfg("bfloat16", 64, "thd")), dict(o32=True)):
        args = {**kw, "epilogue": "tma", **bad}
        with pytest.raises(NotImplementedError, match="epilogue='tma'"):
            build_fwd_ws(args.pop("cfg", cfg), t, **args)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles for sm_90a without a GPU)")
def test_tma_epilogue_compiles_for_hopper():
    """nvcc accepts the windowed kind's kernel with epilogue="tma" (gpt-oss SWA's, bshd): one TMA store site and
    the wait for its reads (ptxas -v on the CPU host, docs/perf-log.md v26: 128 registers, no spill, as with "wg")."""
    import subprocess

    from flashsink.ops.compiler.compile import compile_args
    from flashsink.ops.compiler.compile import jit
    from flashsink.kernel_config import fwd_window_tiles
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    cfg = _cfg("bfloat16", 64, "bshd")
    f = build_fwd_ws(cfg, fwd_window_tiles(cfg), fold=True, epilogue="tma", q_slots=2, pack_gqa=True)
    src = jit(f, cfg, compile_args(f)).get_kernel_source()
    assert src.count("tl::tma_store(O_desc") == 1 and "tl::tma_store_wait<0, true>()" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles for sm_90a without a GPU)")
def test_ws_compiles_for_hopper():
    """nvcc accepts the generated CUDA (wgmma, setmaxnreg, mbarriers): the D64 causal configuration of
    gpt-oss's full layers."""
    import tilelang

    from flashsink.ops.compiler.compile import pass_configs

    func = _ws(_cfg(d=64), Tiles(128, 128, 256, 2))
    kern = tilelang.compile(func, target={"kind": "cuda", "arch": "sm_90a"}, execution_backend="tvm_ffi",
                            pass_configs=pass_configs())
    src = kern.get_kernel_source()
    assert "wgmma_rs" in src and "wgmma_ss" in src and "wait_wgmma<1>" in src


@pytest.mark.parametrize("cfg,want", [
    (_cfg(), True),
    (_cfg("float16", 64, "thd"), True),
    (_cfg(d=64, causal=False, sinks=False, groups=1), True),
    (KernelConfig("sm_90a", "bfloat16", 128, 64, 8, True, True, "bhsd", deterministic=False, precision="strict"), False),  # v's own head dim: not measured
    (_cfg(d=32), False),
    (_cfg(d=256), False),
    (_cfg(arch="sm_80"), False),
])
def test_library_forward_is_ws_where_config_says(cfg, want):
    """config.fwd_ws picks the hand kernel for the library's forward (Hopper, equal head dims 64 or
    128), with 192-row tiles at D64; elsewhere the pipelined kernel."""
    from flashsink.ops.compiler.compile import build_prim_func
    from flashsink.kernel_config import fwd_tiles, fwd_ws

    assert fwd_ws(cfg) == want
    text = build_prim_func("fwd", cfg).script()
    assert ("set_max_nreg" in text and "wait_wgmma" in text) == want
    if want:
        assert f'"tl.launch_threads": [{fwd_tiles(cfg).block_m * 2 + 128}, 1, 1]' in text
        assert fwd_tiles(cfg).block_m == (192 if cfg.head_dim == 64 else 128)


@pytest.mark.parametrize("cfg,opts", [
    (_cfg(d=64), {"epilogue": "regs", "q_slots": 2, "pack_gqa": True}),
    (_cfg("float16", 64, "bshd", sinks=False), {"epilogue": "regs", "q_slots": 2, "pack_gqa": True}),
    (_cfg("float16", 64, "thd"), {"epilogue": "regs", "q_slots": 2, "pack_gqa": True}),
    (_cfg(d=64, causal=False), {"epilogue": "regs", "q_slots": 2, "pack_gqa": True}),
    (_cfg(d=64, groups=1), {"epilogue": "regs", "q_slots": 2, "pack_gqa": False}),
    (_cfg(d=128), {"epilogue": "wg", "q_slots": 1}),
    (_cfg("float16", 128, "thd"), {"epilogue": "wg", "q_slots": 1}),
    (_cfg(d=32), {"epilogue": "smem", "q_slots": 1}),  # not fwd_ws.py's kernel
    (_cfg(d=64, arch="sm_80"), {"epilogue": "smem", "q_slots": 1}),
    (_cfg(d=128, arch="sm_80"), {"epilogue": "smem", "q_slots": 1}),
])
def test_the_forward_options_follow_the_head_dim(cfg, opts):
    """config.fwd_ws_options: head dim 64's forward stores o from registers, double-buffers Q
    (measured faster there on causal and windowed problems, docs/perf-log.md v15) and packs a GQA group
    into one tile where it fits (docs/perf-log.md v18), 128's stages each consumer warpgroup's rows of o and
    stores them 16 bytes a thread (epilogue "wg", docs/perf-log.md v24) with one Q slot; the kinds fwd and fwd_unfolded are that kernel at the forward's own tiles,
    strict's fwd_o32 keeps the defaults; every kind masks by the row limits; a narrow window's kind (fwd_window) is the
    next test's."""
    import dataclasses

    from flashsink.ops.compiler.compile import build_prim_func
    from flashsink.kernel_config import fwd_fold, fwd_o32, fwd_o32_tiles, fwd_tiles, fwd_ws, fwd_ws_options
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws
    from flashsink.ops.compiler.kinds import KINDS

    assert fwd_ws_options(cfg) == opts
    assert [k for k in KINDS if k.startswith("fwd")] == ["fwd", "fwd_unfolded", "fwd_window", "fwd_o32", "fwd_split",
                                                         "fwd_kvcache"]
    if not fwd_ws(cfg):
        return
    t = fwd_tiles(cfg)
    assert build_prim_func("fwd", cfg).script() == build_fwd_ws(cfg, t, fold=fwd_fold(cfg), **opts).script()
    assert build_prim_func("fwd_unfolded", cfg).script() == build_fwd_ws(cfg, t, fold=False, **opts).script()
    strict = dataclasses.replace(cfg, precision="strict")
    if fwd_o32(strict):
        assert build_prim_func("fwd_o32", strict).script() == build_fwd_ws(
            strict, fwd_o32_tiles(strict), fold=True, o32=True, epilogue="smem", q_slots=1).script()


#: the windowed kind's tiles at head dim 64 where the group packs into config.FWD_WINDOW_ROWS_D64 rows
_W64 = Tiles(FWD_WINDOW_ROWS_D64, 64, 2 * FWD_WINDOW_ROWS_D64, 3)


@pytest.mark.parametrize("cfg,tiles", [
    (_cfg(d=64), _W64),
    (_cfg("float16", 64, "bshd", sinks=False), _W64),
    (_cfg("bfloat16", 64, "thd"), _W64),
    (_cfg(d=64, groups=2), _W64),
    (_cfg(d=64, groups=6), Tiles(192, 64, 384, 3)),  # no whole groups of 6 in 256 rows: 192 rows, 32 positions
    (_cfg("float16", 64, "thd", groups=3), Tiles(192, 64, 384, 3)),
    (_cfg("float16", 128), Tiles(128, 64, 256, 3)),
    (_cfg("float16", 128, "bshd", groups=2), Tiles(128, 64, 256, 3)),
    (_cfg("bfloat16", 128, "thd", groups=4), None),  # packed batches at 128: ptxas spills 76 bytes
    (_cfg(d=64, groups=1), None),  # nothing to pack
    (_cfg(d=64, groups=5), None),  # 192 rows are no whole groups of 5
    (_cfg(d=128, groups=32), None),  # 4 positions a head: less than one 8-row swizzle atom
    (_cfg(d=64, causal=False), None),  # a window needs the causal mask
    (_cfg(d=32), None),  # not fwd_ws.py's kernel
    (_cfg(d=64, arch="sm_80"), None),
])
def test_fwd_window_is_the_packed_forward_with_64_key_tiles(cfg, tiles):
    """config.fwd_window_tiles: a window of at most WINDOW_TILES_MAX keys runs the kind ``fwd_window``
    where a GQA group packs into its rows (head dim 64: config.FWD_WINDOW_ROWS_D64 where the group divides
    them into whole 8-row atoms, else 192, docs/perf-log.md v28; 128: 128 rows): 64-key tiles, three ring
    slots, the group packed, each consumer warpgroup staging its own rows and one of its threads storing
    them by TMA (epilogue "tma", docs/perf-log.md v27; packed batches "wg", 16 bytes a thread, v24), two Q
    slots (head dim 128 since v26), folded as the forward is; elsewhere the kind is not built and the
    forward's tiles stand."""
    from flashsink.ops.compiler.compile import build_prim_func
    from flashsink.kernel_config import WINDOW_TILES_MAX, fwd_fold, fwd_tiles, fwd_window_tiles, fwd_windowed
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws
    from flashsink.ops.compiler.kinds import KINDS, kinds_for

    assert WINDOW_TILES_MAX == 128
    want = tiles is not None
    assert fwd_windowed(cfg) == want
    assert ("fwd_window" in kinds_for(cfg)) == want and KINDS["fwd_window"].builds(cfg) == want
    if not want:
        assert fwd_window_tiles(cfg) == fwd_tiles(cfg)
        with pytest.raises(NotImplementedError, match="fwd_window.*sm_90a.*kind fwd"):
            build_prim_func("fwd_window", cfg)
        return
    assert fwd_window_tiles(cfg) == tiles
    opts = {"epilogue": "wg" if cfg.layout == "thd" else "tma", "q_slots": 2}
    text = build_prim_func("fwd_window", cfg).script()
    assert text == build_fwd_ws(cfg, tiles, fold=fwd_fold(cfg), pack_gqa=True, **opts).script()
    assert f'"tl.launch_threads": [{tiles.block_m * 2 + 128}, 1, 1]' in text  # the consumers and the producer
    assert text != build_prim_func("fwd", cfg).script()


@pytest.mark.parametrize("groups,rows", [(8, 256), (2, 256), (16, 256), (6, 192), (3, 192)])
def test_fwd_window_takes_256_rows_at_head_dim_64_where_the_group_packs(monkeypatch, groups, rows):
    """config.FWD_WINDOW_ROWS_D64 = 256 (measured 12-14% faster, docs/perf-log.md v28; the default since v29;
    patched here so the test holds whatever the default): the windowed kind's tiles at head dim 64 take 256
    rows where the group packs into them and 192 where it does not, and the kernel is built with four
    consumer warpgroups (640 threads, setmaxnreg 112 for the consumers)."""
    from flashsink import kernel_config as config
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    monkeypatch.setattr(config, "FWD_WINDOW_ROWS_D64", 256)
    cfg = _cfg(d=64, layout="bshd", groups=groups)
    t = config.fwd_window_tiles(cfg)
    assert t == Tiles(rows, 64, 2 * rows, 3)
    text = build_fwd_ws(cfg, t, fold=True, **config.fwd_ws_options(cfg, t, window=True)).script()
    assert f'"tl.launch_threads": [{2 * rows + 128}, 1, 1]' in text
    assert f"T.set_max_nreg({consumer_regs(rows // 64)}, 1)" in text


@pytest.mark.parametrize("window,scale,want", [
    (128, 0.125, "fwd_window"), (1, 0.125, "fwd_window"), (129, 0.125, "fwd"), (1 << 30, 0.125, "fwd"),
    (128, -0.125, "fwd_unfolded"), (1 << 30, 0.0, "fwd_unfolded"),
])
def test_the_forward_kind_follows_window_and_scale(window, scale, want):
    """kinds.forward_kind (the forward dense.forward launches): a scale <= 0 takes the unfolded forward, whatever the window; a window of at
    most WINDOW_TILES_MAX keys the windowed tiles where the group packs (gpt-oss's 8 heads at head dims
    64 and 128); else the forward. A group that does not pack has no windowed kind; sm_80 has one
    forward, unfolded."""
    from flashsink.ops.compiler.kinds import forward_kind

    assert forward_kind(_cfg(d=64), window, scale) == want
    assert forward_kind(_cfg(d=128), window, scale) == want
    assert forward_kind(_cfg(d=64, groups=1), window, scale) == want.replace("fwd_window", "fwd")
    assert forward_kind(_cfg(d=64, arch="sm_80"), window, scale) == "fwd"


@pytest.mark.parametrize("d,tiles", [(128, Tiles(128, 128, 256, 2)), (64, Tiles(128, 128, 256, 2))])
def test_o32_option_adds_an_fp32_output_and_a_second_pv_term(d, tiles):
    """``build_fwd_ws(o32=True)`` (strict's training forward, the kind ``fwd_o32``; lab/fwd_variants.py's
    "ws/fold/o32"): the default launch plus one output, ``O32`` (o's shape, fp32), stored
    from the normalized accumulator; P @ V issued as two products (hi and lo: one more wgmma in the
    loop and one in the tail) and waited for accordingly; the fast configuration refuses it."""
    from flashsink.ops.compiler.compile import build_prim_func
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    cfg = _cfg(d=d)
    lib = build_prim_func("fwd", cfg)
    func = build_fwd_ws(cfg, tiles, fold=True, o32=True)
    assert _params(func) == _params(lib) + ["O32"]
    assert _dtypes(func) == _dtypes(lib) + ["float32"]
    o, o32 = (func.buffer_map[func.params[i]] for i in (_params(func).index("O"), -1))
    assert [str(x) for x in o32.shape] == [str(x) for x in o.shape]
    text, plain = func.script(), build_fwd_ws(cfg, tiles, fold=True).script()
    assert text.count("wgmma_gemm") == plain.count("wgmma_gemm") + 2
    assert "T.wait_wgmma(2)" in text and "T.wait_wgmma(2)" not in plain
    assert "O32[" in text
    with pytest.raises(ValueError, match="o32"):
        build_fwd_ws(KernelConfig("sm_90a", "bfloat16", d, d, 8, True, True, "bhsd", False, "fast"), tiles, o32=True)


@pytest.mark.parametrize("d,tiles", [(128, Tiles(128, 128, 256, 2)), (64, Tiles(128, 128, 256, 2)),
                                     (64, Tiles(192, 128, 384, 2))])
def test_register_epilogue_option_drops_the_consumer_barriers(d, tiles):
    """``build_fwd_ws(epilogue="regs")`` (head dim 64's forward since docs/perf-log.md v15, config.fwd_ws_options): the same
    launch; o stored from a register fragment in the input dtype instead of staged in shared memory, so
    the two barriers of every consumer thread at a tile's end (barrier CONSUMER_BARRIER) are gone and the
    ping-pong's barriers stay; the default ("smem") is what build_fwd_ws builds unasked; another value is refused."""
    from flashsink.ops.kernels.fwd_ws import CONSUMER_BARRIER, PINGPONG_BARRIER, build_fwd_ws

    cfg = _cfg(d=d)
    func = build_fwd_ws(cfg, tiles, fold=True, epilogue="regs")
    smem = build_fwd_ws(cfg, tiles, fold=True)
    assert _params(func) == _params(smem) and _dtypes(func) == _dtypes(smem)
    assert smem.script() == build_fwd_ws(cfg, tiles, fold=True, epilogue="smem").script()
    text, plain = func.script(), smem.script()
    consumers = tiles.block_m * 2
    barrier = f'tvm_storage_sync("shared", {CONSUMER_BARRIER}, {consumers})'
    assert plain.count(barrier) == 2 and barrier not in text
    turns = f'tvm_storage_sync("shared", {PINGPONG_BARRIER} + wg, 256)'
    assert text.count(turns) == plain.count(turns) == 2
    assert 'o_s = T.sblock_alloc_buffer' in plain and "o_s" not in text
    assert 'scope="local.fragment"' in next(line for line in text.splitlines() if "o_r = " in line)
    with pytest.raises(ValueError, match="epilogue"):
        build_fwd_ws(cfg, tiles, epilogue="global")


@pytest.mark.parametrize("epilogue", ["smem", "regs"])
def test_double_buffered_q_option(epilogue):
    """``build_fwd_ws(q_slots=2)`` (head dim 64's forward since docs/perf-log.md v15): Q gets a second
    shared buffer and a second pair of barriers, each tile's slot and phase from the count of query tiles
    gone through (``q_done % 2``, ``(q_done // 2) & 1``), as the K/V rings do; the same launch. One slot is
    what build_fwd_ws builds unasked, TIR for TIR; slot counts other than 1-3 are refused."""
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    cfg, tiles = _cfg(d=64), Tiles(128, 128, 256, 2)
    func = build_fwd_ws(cfg, tiles, fold=True, epilogue=epilogue, q_slots=2)
    one = build_fwd_ws(cfg, tiles, fold=True, epilogue=epilogue)
    assert one.script() == build_fwd_ws(cfg, tiles, fold=True, epilogue=epilogue, q_slots=1).script()
    assert _params(func) == _params(one) and _dtypes(func) == _dtypes(one)
    text = func.script()
    q_alloc = next(line for line in text.splitlines() if "q_s = T.sblock_alloc_buffer" in line)
    assert "(2, 128, 64)" in q_alloc
    assert "q_done[0] % 2" in text and "q_done[0] // 2" in text and "q_done[0] % 2" not in one.script()
    with pytest.raises(ValueError, match="q_slots"):
        build_fwd_ws(cfg, tiles, q_slots=4)


@pytest.mark.parametrize("d,tiles,opts", [
    (64, Tiles(192, 64, 384, 3), {"q_slots": 2, "pack_gqa": True}),  # gpt-oss SWA's windowed kernel
    (128, Tiles(128, 64, 256, 3), {"pack_gqa": True}),  # golden's
    (128, Tiles(128, 128, 256, 2), {}),  # the D128 forward's
])
def test_warpgroup_epilogue_option(d, tiles, opts):
    """``build_fwd_ws(epilogue="wg")`` (the windowed kind and head dim 128's forward since docs/perf-log.md v24):
    the staged epilogue's shared buffer, swizzled, but each consumer warpgroup meets only its own 128
    threads around its rows (barrier STORE_BARRIER + wg, twice a tile), never the others (no barrier of
    every consumer thread) and still takes the ping-pong's turns; the same launch."""
    from flashsink.ops.kernels.fwd_ws import CONSUMER_BARRIER, PINGPONG_BARRIER, STORE_BARRIER, build_fwd_ws

    cfg = _cfg(d=d)
    func = build_fwd_ws(cfg, tiles, fold=True, epilogue="wg", **opts)
    smem = build_fwd_ws(cfg, tiles, fold=True, epilogue="smem", **opts)
    assert _params(func) == _params(smem) and _dtypes(func) == _dtypes(smem)
    text = func.script()
    assert f'tvm_storage_sync("shared", {STORE_BARRIER} + wg, 128)' in text
    assert text.count(f'tvm_storage_sync("shared", {STORE_BARRIER} + wg, 128)') == 2
    assert f'tvm_storage_sync("shared", {CONSUMER_BARRIER}, {tiles.block_m * 2})' not in text
    assert text.count(f'tvm_storage_sync("shared", {PINGPONG_BARRIER} + wg, 256)') == 2
    assert 'sblock_alloc_buffer((%d, %d), "bfloat16", data=o_s' % (tiles.block_m, d) in text
    assert "for v in T.vectorized(8):" in text  # 16 bytes a store
    assert PINGPONG_BARRIER + tiles.block_m // 64 <= STORE_BARRIER and STORE_BARRIER + tiles.block_m // 64 <= 16


def test_warpgroup_epilogue_refuses_head_dims_it_cannot_tile():
    """A warpgroup's 64 rows in 16-byte runs over 128 threads: value head dims that are multiples of 16."""
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    cfg = KernelConfig("sm_90a", "bfloat16", 64, 40, 8, True, True, "bhsd", deterministic=False, precision="strict")
    with pytest.raises(NotImplementedError, match="multiples of 16; got 40"):
        build_fwd_ws(cfg, Tiles(128, 64, 256, 2), epilogue="wg")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles for sm_90a without a GPU)")
def test_warpgroup_epilogue_stores_16_bytes_a_thread():
    """nvcc accepts gpt-oss SWA's windowed kernel with the "wg" epilogue, and its stores of o are 16 bytes
    wide (where the register epilogue's are 4: half a 32-byte sector, docs/perf-log.md v24)."""
    import tilelang

    from flashsink.ops.compiler.compile import pass_configs
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    func = build_fwd_ws(_cfg(d=64, layout="bshd"), Tiles(192, 64, 384, 3), fold=True, epilogue="wg", q_slots=2,
                        pack_gqa=True)
    kern = tilelang.compile(func, target={"kind": "cuda", "arch": "sm_90a"}, execution_backend="tvm_ffi",
                            pass_configs=pass_configs())
    src = kern.get_kernel_source()
    assert "*(uint4*)(O + " in src and "*(uint1*)(O + " not in src
    assert "ptx_stmatrix" in src  # the accumulator to the swizzled buffer


def test_pack_gqa_option_packs_a_group_into_one_tile():
    """``build_fwd_ws(pack_gqa=True)`` (lab/fwd_variants.py's ".../pack", to be measured): a tile is
    the GQA group's heads, ``block_m / groups`` positions each, head after head. Q arrives as one box
    per head into its rows of the one buffer; each row's position (mask, o, lse) is ``p0 + i % P`` and
    its head (sink, o, lse) ``h0 + i // P``; the tiles run over KV heads; the launch is the same. Off, it
    is the kernel built without it, TIR for TIR."""
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    cfg, tiles = _cfg(d=64), Tiles(192, 128, 384, 2)
    packed = build_fwd_ws(cfg, tiles, fold=True, epilogue="regs", q_slots=2, pack_gqa=True)
    plain = build_fwd_ws(cfg, tiles, fold=True, epilogue="regs", q_slots=2)
    assert plain.script() == build_fwd_ws(cfg, tiles, fold=True, epilogue="regs", q_slots=2, pack_gqa=False).script()
    assert _params(packed) == _params(plain) and _dtypes(packed) == _dtypes(plain)
    text = packed.script()
    load = next(line for line in text.splitlines() if "T.tma_copy(T.region(Q[" in line)
    assert "head_1 * 8 + g" in load and "bx_2 * 24" in load and ", 24, 64)" in load  # _load_q's arguments
    assert "Sinks[head_1 + i // 24]" in text
    assert "i % 24" in text and "h_1: T.int32 = head[0] * 8" in text and "LSE[b_2, h_1 + i // 24, s0 + i % 24]" in text
    assert "heads // 8" in text  # the tiles run over the KV heads


@pytest.mark.parametrize("cfg,packs", [
    (_cfg(d=64), True),  # gpt-oss: 8 heads of 24 positions in 192 rows
    (_cfg(d=64, layout="thd"), True),  # packed batches pack too (measured: varlen)
    (_cfg(d=64, groups=4, causal=False), True),
    (_cfg(d=64, groups=1), False),  # no group
    (_cfg(d=64, groups=5), False),  # 192 rows are no whole number of heads
    (_cfg(d=64, groups=16), False),  # 12 rows a head
    (_cfg(d=128), False),  # D128: packable (two boxes a head), not on: golden's tiles would not shrink
])
def test_library_forward_packs_gqa_where_it_fits(cfg, packs):
    """The library's forward (``fwd.build_fwd``, options from ``config.fwd_ws_options``) is the packed
    kernel where ``config.pack_gqa_fits`` (measured on the H200, docs/perf-log.md v18: o and lse bitwise
    equal to the unpacked kernel, gpt-oss SWA 1.11x, varlen 1.36-1.39x), TIR for TIR, and the unpacked
    one elsewhere; custom tiles that cannot pack fall back instead of refusing."""
    from flashsink.kernel_config import fwd_tiles, fwd_ws_options, pack_gqa_fits
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    tiles = fwd_tiles(cfg)
    opts = fwd_ws_options(cfg)
    assert opts.get("pack_gqa", False) is packs
    assert pack_gqa_fits(cfg, tiles.block_m) is (packs or cfg.head_dim == 128)
    lib = fwd.build_fwd(cfg).script()
    base = {"epilogue": "regs", "q_slots": 2} if cfg.head_dim == 64 else {"epilogue": "wg"}
    assert lib == build_fwd_ws(cfg, tiles, fold=True, pack_gqa=packs, **base).script()
    if packs:
        assert lib != build_fwd_ws(cfg, tiles, fold=True, pack_gqa=False, **base).script()
        # 128 rows: 16 positions of 8 heads or 32 of 4; 160 rows: 40 of 4, but 20 of 8 (no whole atoms)
        assert fwd_ws_options(cfg, Tiles(128, 128, 256, 2))["pack_gqa"] is (cfg.groups in (4, 8))
        assert fwd_ws_options(cfg, Tiles(160, 128, 320, 2))["pack_gqa"] is (cfg.groups == 4)


@pytest.mark.parametrize("cfg,bm", [
    (_cfg(d=64, groups=1), 192),  # no group to pack
    (_cfg(d=64, groups=5), 192),  # 192 rows are no whole number of heads
    (_cfg(d=64, groups=16), 192),  # 12 rows a head: not whole 8-row swizzle atoms
    (_cfg(d=128, groups=3), 128),  # nor at D128
])
def test_pack_gqa_refuses_what_it_cannot_pack(cfg, bm):
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    with pytest.raises(NotImplementedError, match="pack_gqa"):
        build_fwd_ws(cfg, Tiles(bm, 128, bm * 2, 2), fold=True, pack_gqa=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles for sm_90a without a GPU)")
def test_pack_gqa_compiles_for_hopper():
    """nvcc accepts the packed kernel: one TMA box of 24 rows per head of gpt-oss's group, each
    announcing its own 3072 bytes on the one Q barrier before the producer's single arrival."""
    import tilelang

    from flashsink.ops.compiler.compile import pass_configs
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    func = build_fwd_ws(_cfg(d=64), Tiles(192, 128, 384, 2), fold=True, epilogue="regs", q_slots=2, pack_gqa=True)
    kern = tilelang.compile(func, target={"kind": "cuda", "arch": "sm_90a"}, execution_backend="tvm_ffi",
                            pass_configs=pass_configs())
    src = kern.get_kernel_source()
    assert src.count("expect_transaction(3072)") == 1 and "for (int g = 0; g < 8; ++g)" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles for sm_90a without a GPU)")
def test_pack_gqa_compiles_at_head_dim_128():
    """At head dim 128 (lab/fwd_variants.py's ".../pack 128x128", golden's tiles) a head's 16 rows
    are two TMA boxes, one per 64-column half of the swizzled Q buffer (a [16, 128] box is no bijection
    for TileLang 0.1.15's lowering): 8 heads x 2 boxes of 2048 bytes, each half's rows at
    ``hc * 8192 + g * 1024`` elements; nvcc builds it, and no lane is elected under a narrow branch."""
    import tilelang

    from flashsink.ops.compiler.compile import narrow_elections
    from flashsink.ops.compiler.compile import pass_configs
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    func = build_fwd_ws(_cfg("float16", 128), Tiles(128, 128, 256, 2), fold=True, pack_gqa=True)
    kern = tilelang.compile(func, target={"kind": "cuda", "arch": "sm_90a"}, execution_backend="tvm_ffi",
                            pass_configs=pass_configs())
    src = kern.get_kernel_source()
    assert src.count("expect_transaction(2048)") == 1 and "for (int hc = 0; hc < 2; ++hc)" in src
    assert "((hc * 8192) + (g * 1024))" in src and narrow_elections(src) == []


def test_pack_gqa_on_packed_batches():
    """A packed batch (thd) packs the same way: the varlen scheduler's program slots count tiles of
    ``block_m / groups`` positions (``schedule.grid`` with that block: ``total // 24 + n_seqs - 1``
    slots per KV head), a sequence's tile is found with that block, and rows past a sequence's end
    (the next sequence's) are neither stored nor counted in the lse. Off, the kernel is the one
    built without the option."""
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    cfg, tiles = _cfg(d=64, layout="thd"), Tiles(192, 128, 384, 2)
    packed = build_fwd_ws(cfg, tiles, fold=True, epilogue="regs", q_slots=2, pack_gqa=True)
    plain = build_fwd_ws(cfg, tiles, fold=True, epilogue="regs", q_slots=2)
    assert plain.script() == build_fwd_ws(cfg, tiles, fold=True, epilogue="regs", q_slots=2, pack_gqa=False).script()
    assert _params(packed) == _params(plain) and _dtypes(packed) == _dtypes(plain)
    text, plain_text = packed.script(), plain.script()
    assert "m_tiles: T.int32 = seq_q // 24 + (n_cu - 1)" in text and "seq_q // 192 + (n_cu - 1)" in plain_text
    assert "// 24 + mid" in text  # the slot search: slot(b) = cu[b] // 24 + b
    load = next(line for line in text.splitlines() if "T.tma_copy(T.region(Q[" in line)
    assert "head_1 * 8 + g" in load and ", 24, 1, 64)" in load  # _load_q's arguments
    assert "LSE[h_1 + i // 24, base_1 + s0 + i % 24]" in text  # thd's [heads, rows] statistic, row by row
    assert "heads // 8" in text


def _waits_after_pins(text: str) -> list:
    """For each ``T.wait_wgmma(0)`` of a kernel's TIR, whether the line before it stores ``l`` to ``l_pin``."""
    lines = [line.strip() for line in text.splitlines()]
    return [lines[i - 1].startswith("T.copy(T.region(l[0]") and "l_pin[0]" in lines[i - 1]
            for i, line in enumerate(lines) if line == "T.wait_wgmma(0)"]


def test_key_limits_mask_exactly_the_invisible_keys():
    """``mask.key_limits``, the row limits the forward's masked tiles compare each column with: key ``key0 + j``
    passes ``lo < j <= hi`` exactly where ``visibility``'s test (``mask.visible``, the per-element mask it
    replaces) says it is visible: causal and full, windows from 1 to none, rows past the sequence (a tile's
    padding), keys past it, seq_q below, equal to and above seq_kv (bottom-right alignment), tiles anywhere."""
    import itertools
    import random

    from flashsink.kernel_config import NO_WINDOW
    from flashsink.ops.tir.mask import key_limits, visible

    def select(cond, a, b):
        return a if cond else b

    rng = random.Random(0)
    checked = 0
    for causal, (sq, sk), window in itertools.product((True, False), ((37, 37), (19, 53), (53, 19), (1, 64)),
                                                       (1, 3, 16, 128, NO_WINDOW)):
        for _ in range(6):
            key0 = rng.randrange(0, sk + 16)
            for row in range(0, sq + 9):
                hi, lo = key_limits(row, key0, sq, sk, window, causal, select)
                for j in range(64):
                    key = key0 + j
                    assert (lo < j <= hi) == bool(visible(row, key, sq, sk, window, causal)), \
                        (causal, sq, sk, window, key0, row, j, hi, lo)
                    checked += 1
    assert checked > 500_000


@pytest.mark.parametrize("d,tiles,opts", [
    (64, Tiles(192, 64, 384, 3), {"epilogue": "regs", "q_slots": 2, "pack_gqa": True}),
    (128, Tiles(128, 128, 256, 2), {}),
])
def test_masked_tiles_mask_through_row_limits(d, tiles, opts):
    """The masked tiles (``mask.limit_logits``): two int32 row fragments, filled on each masked tile from
    ``mask.key_limits`` less the thread's column offset in the wgmma accumulator, and the per-element
    select compares the column with them instead of re-deriving the row's visibility."""
    cfg = _cfg(d=d)
    text = build_fwd_ws(cfg, tiles, fold=True, **opts).script()
    frags = [line.strip() for line in text.splitlines() if '"int32", scope="local.fragment"' in line]
    assert frags == [f'key_{n} = T.sblock_alloc_buffer(({tiles.block_m},), "int32", scope="local.fragment")'
                     for n in ("hi", "lo")]
    # the per-element test holds no sequence ends (`sq`, `sk`): only the limits do
    selects = [line for line in text.splitlines() if "acc_s[i, j] = T.if_then_else(" in line]
    assert len(selects) >= 1
    assert all("key_hi[i]" in line and "sk" not in line for line in selects)
    assert "% 4" in text  # the thread's column offset
