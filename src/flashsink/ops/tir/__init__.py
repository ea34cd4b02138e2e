"""The concepts the kernels are written in, one per file, shared by forward and backward.

``mask`` (which (row, key) pairs are visible), ``block_range`` (which blocks a tile visits),
``softmax`` (the online softmax whose normalizer starts from the sink), ``schedule`` (which sequence
and tile a program runs), ``layout`` (addressing of bhsd / bshd / thd, signature helpers), ``split``
(the two-term ``hi + lo`` products of strict mode).

May import ``flashsink.kernel_config`` and ``flashsink.visibility``; nothing of ``kernels``,
``launch`` or the rest of ``build``.
"""
