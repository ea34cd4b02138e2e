"""The registry drives every list of kernels: a kind is one row of ``kinds.KINDS`` plus its builder.
docs/architecture.md, "Adding a kernel kind", followed once for a toy kind: with no other edit, first use,
``flashsink precompile``, the disk-cache key, the forward's choice per call, ``tools/tir_hashes.py`` and
the docs' table all see it (or, for the table, fail until it is documented)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from flashsink.ops.compiler import compile as keys, kinds, precompile
from flashsink.kernel_config import KernelConfig
from flashsink.ops.compiler.kinds import KINDS, Kind
from flashsink.ops.launch import dense

pytestmark = pytest.mark.l0

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cfg(arch="sm_90a", **over):
    base = dict(arch=arch, dtype="bfloat16", head_dim=64, head_dim_v=64, groups=8, causal=True, has_sinks=True,
                layout="bhsd", deterministic=False, precision="fast")
    return KernelConfig(**{**base, **over})


def build_toy(cfg: KernelConfig):
    """Step 1 of the recipe: a builder ``KernelConfig -> PrimFunc`` (here twice its input)."""
    import tilelang.language as T

    n = 128

    @T.prim_func
    def flashsink_toy(X: T.Tensor((n,), "float32"), Y: T.Tensor((n,), "float32")):
        with T.Kernel(1, threads=n) as _:
            for i in T.Parallel(n):
                Y[i] = X[i] * 2.0

    return flashsink_toy


#: step 2: one row, launched by every Hopper configuration's forward + backward
TOY = Kind(build_toy, None, needed=lambda cfg: cfg.hopper, ignores=("deterministic", "precision"), build_s=1.0)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(KINDS, "toy", TOY)
    return "toy"


def test_a_new_row_is_listed_built_and_keyed_with_no_other_edit(toy):
    cfg = _cfg()
    assert toy in kinds.kinds_for(cfg) and toy not in kinds.kinds_for(_cfg("sm_80"))
    assert toy in kinds.first_use_kinds("fwd", cfg)  # a first use builds it beside the forward
    assert toy in kinds.precompile_kinds(cfg) and toy in precompile.supported_kinds(cfg)
    assert kinds.check_kind(toy) is TOY and toy in kinds.route_kinds("dense")
    assert kinds.canonical(toy, cfg).precision == kinds.CANONICAL["precision"]
    func = keys.build_prim_func(toy, cfg)
    assert "flashsink_toy" in func.script()
    key = keys.cache_key(toy, kinds.canonical(toy, cfg), func, keys.compile_args(func))
    assert key["kind"] == toy and key["tiles"] == {}


def test_tir_hashes_enumerates_the_registry(toy, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("tir_hashes", ROOT / "tools" / "tir_hashes.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "hashes.txt"
    tool.main(["--kinds", toy, "--quick", "--arch", "sm_90a", "-o", str(out)])
    lines = out.read_text().splitlines()
    assert lines and all(line.startswith("toy ") and re.search(r" [0-9a-f]{64}$", line) for line in lines)


def test_a_forward_row_is_chosen_by_its_predicate(monkeypatch):
    """A forward the dense route launches instead of "fwd" is a row with ``chosen_when``: the launch layer
    asks the registry (``kinds.forward_kind``), so no launch code changes."""
    monkeypatch.setitem(KINDS, "toy_fwd", Kind(build_toy, None, needed=lambda cfg: False,
                                               chosen_when=lambda cfg, window, scale: window == 7))
    sm80 = _cfg("sm_80")  # no fwd_window there, so the toy row is the first that takes a window of 7
    assert kinds.forward_kind(sm80, 7, 0.125) == "toy_fwd" and kinds.forward_kind(sm80, 8, 0.125) == "fwd"
    assert "toy_fwd" in kinds.forward_kinds()


def test_the_registry_chooses_todays_forwards():
    hopper = _cfg()
    assert kinds.forward_kinds() == ("fwd", "fwd_unfolded", "fwd_window")
    assert kinds.forward_kind(hopper, 128, 0.125) == "fwd_window"
    assert kinds.forward_kind(hopper, 129, 0.125) == "fwd"
    assert kinds.forward_kind(hopper, 128, -0.125) == "fwd_unfolded"
    assert kinds.forward_kind(_cfg("sm_80"), 128, -0.125) == "fwd"
    assert kinds.kvcache_kinds() == ("fwd_kvcache", "merge_splits")


def _doc_table() -> dict:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Kernel kinds", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| `([\w.]+)` \|", section, flags=re.M))


def _builders() -> dict:
    """Each kind's builder as the docs' table names it: "module.function" in ops/kernels."""
    return {name: f"{f.__module__.split('.')[-1]}.{f.__name__}" for name in KINDS for f in [kinds.builder(name)]}


def test_the_docs_table_is_the_registry():
    assert _doc_table() == _builders()


def test_the_docs_check_fails_for_an_undocumented_kind(toy):
    assert _doc_table() != _builders()


def test_a_kernel_config_names_its_precision():
    """KernelConfig has no default mode (the public functions default to "fast"; a silent "strict" in the
    configuration was a trap): leaving it out is a TypeError."""
    with pytest.raises(TypeError):
        KernelConfig(arch="sm_90a", dtype="bfloat16", head_dim=64, head_dim_v=64, groups=8, causal=True,
                     has_sinks=True, layout="bhsd", deterministic=False)
