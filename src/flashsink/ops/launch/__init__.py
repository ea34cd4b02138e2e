"""The launch layer: the host code between the public functions and the kernels.

``attention`` (the autograd function and its two routes: eager, or the custom ops under
torch.compile), ``custom_ops`` (the ``torch.ops.flashsink`` ops: their schemas, fake and CUDA
implementations), ``dense`` (the launch API both call: ``prepare`` -> ``Plan``, ``forward``,
``backward``), ``decode`` (split-KV decode through ``attention``), ``kvcache`` (``attention_kvcache``).
Modules call each other's public names only.

May import ``flashsink.ops.compiler`` and the package's top-level modules (``_validate``, ``reference``,
``combine``, ``visibility``); never ``kernels`` or ``tir`` (nothing here imports tilelang).
"""
