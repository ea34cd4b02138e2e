"""What flashsink assumes of TileLang where it uses public names in place of private ones
(``ops/compiler/compile.py``). Each test reads the private name TileLang itself uses, so a TileLang upgrade that
changes the behaviour fails here, loudly, instead of exporting or launching kernels differently.
No kernel is compiled: the TileLang objects are stand-ins with the attributes these functions read.
"""

from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.l0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flashsink's kernel cache runs on Linux")
@pytest.mark.parametrize("target_host", ["c", "llvm", None])
def test_tilelang_cache_exports_with_no_extra_keywords_on_linux(target_host):
    # compile._write_kernel calls export_library(path) with no keywords, as TileLang's own tvm_ffi
    # cache does here. If this fails, pass TVMFFIKernelCache's export keywords there.
    from tilelang.jit.adapter.kernel_cache import TVMFFIKernelCache

    host = None if target_host is None else SimpleNamespace(kind=SimpleNamespace(name=target_host))
    kernel = SimpleNamespace(artifact=SimpleNamespace(target_host=host))
    assert TVMFFIKernelCache._get_export_kwargs(kernel) == {}


def test_exportable_executable_is_the_one_the_adapter_calls():
    # compile._launcher calls get_exportable_executable() in place of the adapter: it must be the
    # executable the adapter's own call runs (_get_executable, built once and kept).
    from tilelang.jit.adapter.tvm_ffi import TVMFFIKernelAdapter

    executable = object()
    adapter = SimpleNamespace(_get_executable=lambda: executable)
    assert TVMFFIKernelAdapter.get_exportable_executable(adapter) is executable
    assert "self._get_executable()" in inspect.getsource(TVMFFIKernelAdapter._convert_torch_func)
