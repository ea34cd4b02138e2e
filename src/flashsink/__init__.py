"""flashsink: fused TileLang attention kernels with learnable attention sinks (gpt-oss style).

``import flashsink`` stays light: tilelang is only imported when a CUDA tensor reaches a kernel.
"""

from . import reference, testing
from .api import attention, attention_kvcache, attention_varlen
from .combine import combine
from .errors import CacheDirError, CompileError

__version__ = "0.1.0"

__all__ = ["attention", "attention_kvcache", "attention_varlen", "combine", "reference", "testing", "__version__"]
__all__ += ["CompileError", "CacheDirError"]
