"""The kernels' names and parameter lists: the launch protocol of ``ops/launch/dense.py`` (which passes
arguments positionally), written out for every layout and option that changes a signature.

Each builder writes one prim_func for padded and packed (thd) batches; the packed kernels' extra
parameters and the bwd's dQ accumulator are dropped through ``layout.optional``, which relies on
how TileLang's parser treats a callable annotation. This pins that. Lowering only: no nvcc, no GPU.
"""

import pytest

pytest.importorskip("tilelang")

from flashsink.ops.compiler.compile import build_prim_func  # noqa: E402
from flashsink.kernel_config import KernelConfig  # noqa: E402

pytestmark = pytest.mark.l0

VARLEN_Q = ["CuQ", "CuK", "max_seqlen_q"]
VARLEN_K = ["CuQ", "CuK", "max_seqlen_k"]


def _params(func) -> list:
    return [p.name.removesuffix("_handle") for p in func.params]


def _expected(kind, varlen, precision, deterministic):
    vq, vk = (VARLEN_Q, VARLEN_K) if varlen else ([], [])
    if kind == "fwd":
        return "flashsink_fwd", ["Q", "K", "V", "Sinks", *vq, "window", "scale_log2", "O", "LSE"]
    dq = [] if deterministic else ["dQAcc"]  # the preprocess zeroes it, the main backward adds into it
    if kind == "preprocess" and precision == "fast":
        return "flashsink_bwd_preprocess_fast", ["O", "dO", "LSE", "dLSE", "Sinks", *vq, "Delta", "dSinkAcc",
                                                 "dSinkPart", *dq]
    if kind == "preprocess":
        return "flashsink_bwd_preprocess", ["Q", "K", "V", "dO", "LSE", "dLSE", "Sinks", *vq, "window", "scale",
                                            "Delta", "dSinkAcc", "dSinkPart", *dq]
    if kind == "bwd":
        return "flashsink_bwd", ["Q", "K", "V", "dO", "LSE", "Delta", *vk, "window", "scale", *dq, "dK", "dV"]
    assert kind == "dq"
    return "flashsink_bwd_dq", ["Q", "K", "V", "dO", "LSE", "Delta", *vq, "window", "scale", "dQ"]


@pytest.mark.parametrize("layout", ["bhsd", "thd"])
@pytest.mark.parametrize("kind,precision,deterministic", [
    ("fwd", "fast", False), ("preprocess", "fast", False), ("preprocess", "fast", True), ("preprocess", "strict", False),
    ("preprocess", "strict", True), ("bwd", "fast", False), ("bwd", "strict", True), ("dq", "fast", True),
])
def test_signature(kind, layout, precision, deterministic):
    cfg = KernelConfig("sm_90a", "bfloat16", 64, 64, 2, True, True, layout, deterministic, precision)
    func = build_prim_func(kind, cfg)
    name, params = _expected(kind, layout == "thd", precision, deterministic)
    if layout == "thd":
        name += "_varlen"
    assert str(func.attrs["global_symbol"]) == name
    assert _params(func) == params
