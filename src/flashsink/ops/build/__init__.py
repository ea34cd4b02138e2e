"""Configuration, the kernel registry, and building and caching kernels.

``config`` is the leaf every layer may import: ``KernelConfig`` (the compile-cache key), the tile
tables and the policy functions that choose a kernel variant per configuration. ``kinds`` is the
registry (one row per kernel kind: builder, tiles, when it is launched). ``compile`` lowers a kind's
PrimFunc and compiles it (with ``diskcache``, the verified on-disk cache); ``precompile`` is
``flashsink precompile``.

May import ``build`` itself and the package's leaf modules (``errors``, ``_version``, ``_argtypes``);
the kernels are reached only through the registry's builder names (imported when a kernel is built),
so importing this package does not import tilelang.
"""
