"""The kernels: one file per kernel family, each a builder ``KernelConfig -> PrimFunc``.

``fwd`` (the forward and its kinds), ``fwd_ws`` (the hand warp-specialized Hopper forward),
``bwd`` (Delta, the main backward, deterministic dQ, the accumulators' cast), ``bwd_ws`` (the hand
warp-specialized Hopper backward), ``fwd_split`` / ``fwd_kvcache`` / ``merge_splits`` (split-KV
decode, the paged cache). ``fwd_entry`` and ``bwd_entry`` hold the prim_func signatures that a
family's kernels share (the parameter order is the launch protocol).

May import ``flashsink.ops.tir`` and ``flashsink.kernel_config``; nothing of ``launch``.
"""
