"""The compile layer: the registry of kernel kinds, and building, caching and loading kernels.

- ``kinds``: one row per kernel kind (builder, tiles, when it is launched), read by everything that
  lists, selects or builds kernels;
- ``compile``: one kernel: its PrimFunc, compile arguments and disk-cache key, TileLang's compile with
  retries in a compile process, and ``compile_kernel`` through the disk cache;
- ``diskcache`` and ``cachedir``: the verified on-disk cache and the trust checks of its directory;
- ``registry``: ``get_kernel``, this process's kernels, a configuration's first use, and many kernels
  at once in worker processes;
- ``precompile``: ``flashsink precompile``.

Imports ``flashsink.kernel_config``, the package's leaf modules (``errors``, ``_version``,
``_argtypes``) and, when a kernel is built, ``kernels`` (``kinds.builders``): importing this package
does not import tilelang.
"""
