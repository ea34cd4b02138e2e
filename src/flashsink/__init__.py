"""flashsink: fused TileLang attention kernels with learnable attention sinks (gpt-oss style).

``import flashsink`` stays light: tilelang is only imported when a CUDA tensor reaches a kernel.
"""

from . import reference, testing
from ._version import __version__
from .api import attention, attention_kvcache, attention_varlen
from .combine import combine
from .errors import CacheDirError, CompileError

__all__ = ["attention", "attention_kvcache", "attention_varlen", "combine", "reference", "testing", "__version__"]
__all__ += ["CompileError", "CacheDirError"]
