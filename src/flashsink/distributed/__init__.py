"""Context parallelism on torch.distributed: Ulysses (all-to-all) and ring attention.

Import it as ``flashsink.distributed`` (``import flashsink`` does not load it).

Both split ONE sequence of length S across the P ranks of a process group; every rank passes the
same local length S/P of q, k and v (checked with one small collective per call) and gets back the
output for the tokens it holds. Window and causal positions are global (positions in the full
sequence).

* :func:`ulysses_attention` takes contiguous shards: rank r holds tokens ``[r*S/P, (r+1)*S/P)``.
  An all-to-all gives each rank all tokens for H/P heads (needs ``H % P == 0``).
* :func:`ring_attention` keeps the sequence sharding and passes K/V blocks around a ring of
  point-to-point sends (no head-count constraint). It takes contiguous shards (``zigzag=False``,
  the same as Ulysses) or, by default, zig-zag shards for causal load balance: the sequence is cut
  into 2P chunks of S/(2P) tokens and rank r holds chunks r and 2P-1-r, in that order (S divisible
  by 2P). :func:`shard_sequence`, :func:`unshard_sequence` and :func:`sequence_positions` convert
  between full tensors and either sharding.


Modules: :mod:`.ulysses` (the all-to-all path), :mod:`.ring` (the ring and its planning: which
pieces of a K/V block a rank's queries see), :mod:`.sharding` (which tokens a rank holds, and the
conversions between full tensors and shards).
"""

from .ring import ring_attention
from .sharding import sequence_positions, shard_sequence, unshard_sequence
from .ulysses import ulysses_attention

__all__ = [
    "ring_attention",
    "sequence_positions",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
]
