"""The pipelined forward's options (``fwd.build_fwd_pipelined``: tiles, ``mask``), timed on
the GPU by lab/fwd_variants.py: each builds for sm_90a and sm_80, a few lower through TileLang
and two compile with nvcc; the defaults are exactly the library's kernel. Their numerics are
checked on the GPU by the tool, against the default kernel."""

import shutil

import pytest

from flashsink.kernel_config import KernelConfig, Tiles, fwd_mask, fwd_tiles, fwd_ws


def _cfg(arch, **over):
    base = dict(arch=arch, dtype="bfloat16", head_dim=64, head_dim_v=64, groups=8, causal=True, has_sinks=True,
                layout="bhsd", deterministic=False, precision="strict")
    base.update(over)
    return KernelConfig(**base)


def _script(cfg, **opts):
    """The pipelined kernel's script (fwd_ws.py's kernel has tests of its own, tests/test_fwd_ws.py)."""
    from flashsink.ops.kernels.fwd import build_fwd_pipelined

    return build_fwd_pipelined(cfg, **opts).script()


@pytest.mark.l0
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_default_options_are_the_library_kernel(arch):
    from flashsink.ops.compiler.compile import build_prim_func

    cfg = _cfg(arch)
    lib = build_prim_func("fwd", cfg).script()
    default_mask = "branch" if arch == "sm_90a" else "select"  # config.fwd_mask: measured on the H200
    assert fwd_mask(cfg) == default_mask
    if not fwd_ws(cfg):
        assert _script(cfg, tiles=fwd_tiles(cfg), mask=default_mask) == lib
    assert _script(cfg, mask="select" if default_mask == "branch" else "branch") != lib


@pytest.mark.l1
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("mask", ["select", "branch"])
def test_options_build(arch, mask):
    """Each mask builds a PrimFunc with one pipelined key loop and one select, the scale applied before
    it; "branch" tests the tile's wholly visible blocks."""
    s = _script(_cfg(arch), mask=mask)
    assert s.count('"num_stages"') == 1
    assert s.count("acc_s[i, j] = T.if_then_else(") == 1
    assert "acc_s[i, j] * scale_log2," in s  # the select's scaled value
    assert ("kb >= flo" in s) == (mask == "branch")


@pytest.mark.l1
@pytest.mark.parametrize("tiles", [Tiles(128, 64, 256, 2), Tiles(64, 128, 128, 2), Tiles(192, 128, 384, 2)])
def test_tiles_option(tiles):
    s = _script(_cfg("sm_90a", head_dim=128, head_dim_v=128), tiles=tiles)
    assert f'acc_s = T.sblock_alloc_buffer(({tiles.block_m}, {tiles.block_n}), scope="local.fragment")' in s
    assert f'"tl.launch_threads": [{tiles.threads}, 1, 1]' in s
    assert f'"num_stages": {tiles.stages}' in s


@pytest.mark.l0
def test_unknown_mask_is_a_value_error():
    from flashsink.ops.kernels.fwd import build_fwd_pipelined

    for bad in ("bogus", "split", "flag"):
        with pytest.raises(ValueError, match="mask must be one of"):
            build_fwd_pipelined(_cfg("sm_90a"), mask=bad)


def _lower(arch, **opts):
    """CUDA source after TileLang's whole lowering (layout inference, pipelining, ThreadSync), no nvcc."""
    import tilelang
    import tvm

    from flashsink.ops.compiler.compile import pass_configs
    from flashsink.ops.kernels.fwd import build_fwd_pipelined

    target = {"kind": "cuda", "arch": arch}
    with tvm.transform.PassContext(opt_level=3, config=pass_configs()), tvm.target.Target(target):
        return tilelang.lower(build_fwd_pipelined(_cfg(arch), **opts), target=target).kernel_source


@pytest.mark.l1
@pytest.mark.parametrize("arch, opts", [
    ("sm_90a", dict(mask="branch")), ("sm_90a", dict(mask="select")), ("sm_80", dict(mask="branch")),
])
def test_options_lower(arch, opts):
    src = _lower(arch, **opts)
    assert ("wgmma" in src) == (arch == "sm_90a")


@pytest.mark.l1
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch, opts", [("sm_90a", dict(mask="branch")),
                                        ("sm_80", dict(mask="branch", tiles=Tiles(64, 64, 128, 2)))])
def test_options_compile(arch, opts):
    import tilelang

    from flashsink.ops.compiler.compile import pass_configs
    from flashsink.ops.kernels.fwd import build_fwd_pipelined

    kernel = tilelang.compile(build_fwd_pipelined(_cfg(arch), **opts), target={"kind": "cuda", "arch": arch},
                              execution_backend="tvm_ffi", pass_configs=pass_configs())
    assert "__global__" in kernel.get_kernel_source()
