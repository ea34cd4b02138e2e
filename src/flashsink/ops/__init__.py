"""TileLang kernels for sink attention, in four layers (each a package; the import direction is
pinned by ``tests/test_import_graph.py``), over the base module ``flashsink.kernel_config``
(``KernelConfig``, the tiles and the policy choosing a kernel variant), which every layer imports:

- ``launch/``: what the public functions call on CUDA tensors: the autograd function
  (``attention``), the ``torch.ops.flashsink`` custom ops (``custom_ops``), and the launches of the
  dense route (``dense``, the launch API: ``prepare``, ``forward``, ``backward``), split-KV decode
  (``decode``) and the paged cache (``kvcache``). Imports ``compiler`` only.
- ``compiler/``: the registry of kernel kinds (``kinds``), building and caching kernels (``compile``,
  ``diskcache``, ``registry``, ``precompile``). Imports ``kernels`` (the builders) only when a kernel is built.
- ``kernels/``: one file per kernel family (and the hand warp-specialized Hopper variants), plus the
  shared prim_func signatures (``fwd_entry``, ``bwd_entry``). Imports ``tir``.
- ``tir/``: the concepts the kernels are written in, shared by forward and backward: ``mask``,
  ``softmax`` (the online softmax that starts from the sink), ``block_range``, ``schedule``,
  ``layout``, ``split`` (strict mode's two-term products). Imports nothing of ``ops``.

Importing this package, ``launch`` or ``compiler`` does not import tilelang; ``kernels`` and ``tir`` do.
"""
