"""The kernel registry, and building and caching kernels (``KernelConfig``: ``flashsink.kernel_config``).

``kinds`` is the
registry (one row per kernel kind: builder, tiles, when it is launched). Building a kernel, one job
a module, each importing only those above it in this list:

- ``logs``: the "flashsink" logger and ``FLASHSINK_LOG``;
- ``keys``: a kind's PrimFunc, its compile arguments, the versions and the disk-cache key;
- ``lowering``: one TileLang compile (lowering, nvcc) and the check of its CUDA source;
- ``retry``: which compile failures are transient, the compile with retries, the error's text;
- ``compile``: ``compile_kernel``, a kernel through ``diskcache`` (the verified on-disk cache):
  loaded from a verified entry, or compiled, stored and loaded back;
- ``parallel``: many ``compile_kernel`` calls in worker processes;
- ``registry``: ``get_kernel``, this process's kernels, and a configuration's first use (its
  route's kernels built at once, in parallel);
- ``precompile``: ``flashsink precompile``.

May import ``build`` itself and the package's leaf modules (``errors``, ``_version``, ``_argtypes``);
the kernels are reached only through the registry's builder names (imported when a kernel is built),
so importing this package does not import tilelang.
"""
