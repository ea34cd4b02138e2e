"""TileLang kernels for sink attention.

Layout of this package (one concept per file, shared by forward and backward):

- ``config``: the static configuration of a kernel (the compile-cache key) and the
  per-architecture tile table.
- ``mask``: which (query, key) pairs are visible: causal, sliding window, bottom-right
  alignment, sequence bounds.
- ``block_range``: which KV blocks a query block visits (forward, dQ) and which query
  blocks a KV block visits (dK/dV).
- ``softmax``: the online softmax whose normalizer starts from the sink.
- ``fwd`` / ``bwd``: the kernels; ``fwd_split`` / ``fwd_kvcache`` and ``merge_splits``: split-KV
  decode (``decode``) and ``attention_kvcache`` against a paged KV cache (``kvcache``);
  ``compile``: building and caching them;
  ``interface``: the autograd function behind ``flashsink.attention`` on CUDA tensors.

Importing this package does not import tilelang; the kernel modules do.
"""
