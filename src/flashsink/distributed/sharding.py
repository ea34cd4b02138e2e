"""Which tokens of the global sequence a rank holds, and the conversions between full tensors and
shards (contiguous, as Ulysses takes, or zig-zag, ring attention's default).

A rank's tokens are one or two segments of the global sequence, each described as (global start,
local start, length). Contiguous: rank r holds [r*n, (r+1)*n) with n = S/P. Zig-zag: with c =
S/(2P), rank r holds chunk r ([r*c, (r+1)*c)) then chunk 2P-1-r, so that under a causal mask every
rank has the same amount of work (an early chunk and its mirror late chunk). Also the checks that
:func:`ring_attention` and :func:`ulysses_attention` share: their arguments, the process group, and
that every rank passes the same shapes.
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from .._validate import AttnSpec, check_flags, validate_attention


def segments(rank: int, p: int, local_len: int, zigzag: bool) -> tuple[tuple[int, int, int], ...]:
    """Segments ``(global_start, local_start, length)`` of the tokens rank holds, in local order."""
    if not zigzag:
        return ((rank * local_len, 0, local_len),)
    c = local_len // 2
    return ((rank * c, 0, c), ((2 * p - 1 - rank) * c, c, c))


def _check_rank_args(rank, world_size, zigzag) -> None:
    for name, x in (("world_size", world_size), ("rank", rank)):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(x).__name__} ({x!r})")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    check_flags(zigzag=zigzag)


def _check_seq_len(name: str, seq_len: int, world_size: int, zigzag: bool) -> int:
    """The local length S/P; S must be divisible by P (contiguous) or 2P (zig-zag)."""
    parts = 2 * world_size if zigzag else world_size
    if seq_len % parts != 0:
        how = f"2 * world_size = {parts} (zig-zag: 2P chunks)" if zigzag else f"world_size = {parts}"
        raise ValueError(
            f"{name}: sequence length {seq_len} must be divisible by {how}; pad the sequence"
            + (" or pass zigzag=False (then it needs divisibility by world_size only)" if zigzag else "")
        )
    return seq_len // world_size


def sequence_positions(rank, world_size, seq_len, *, zigzag=True, device=None) -> torch.Tensor:
    """Global positions (int64 ``[seq_len / world_size]``) of the tokens ``rank`` holds, in local order.

    Use them for position ids / RoPE of the local tokens. ``zigzag=True``: chunks ``rank`` and
    ``2*world_size-1-rank`` of ``2*world_size`` equal chunks; ``zigzag=False``: the contiguous chunk
    ``[rank*S/P, (rank+1)*S/P)``.
    """
    _check_rank_args(rank, world_size, zigzag)
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 0:
        raise TypeError(f"seq_len must be a non-negative int, got {type(seq_len).__name__} ({seq_len!r})")
    n = _check_seq_len("seq_len", int(seq_len), world_size, zigzag)
    parts = [torch.arange(g, g + m, device=device) for g, _, m in segments(rank, world_size, n, zigzag)]
    return torch.cat(parts)


def _check_dim(x: torch.Tensor, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} ({dim!r})")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D tensor, got {dim}")
    return dim % x.dim()


def shard_sequence(x, rank, world_size, *, dim=1, zigzag=True) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor ``x`` along ``dim`` (1: "bshd"; 2: "bhsd").

    ``zigzag=True`` (the default of :func:`ring_attention`): chunks ``rank`` and
    ``2*world_size-1-rank`` of ``2*world_size`` equal chunks, concatenated (a new tensor; the
    sequence length must be divisible by ``2*world_size``). ``zigzag=False``: the contiguous chunk
    ``[rank*S/P, (rank+1)*S/P)`` (a view; what :func:`ulysses_attention` takes). Differentiable.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_rank_args(rank, world_size, zigzag)
    dim = _check_dim(x, dim)
    n = _check_seq_len(f"x (dim {dim})", x.shape[dim], world_size, zigzag)
    segs = segments(rank, world_size, n, zigzag)
    if len(segs) == 1:
        return x.narrow(dim, segs[0][0], n)
    return torch.cat([x.narrow(dim, g, m) for g, _, m in segs], dim=dim)


def unshard_sequence(chunks, *, dim=1, zigzag=True) -> torch.Tensor:
    """The full-sequence tensor from every rank's shard (``chunks[r]`` from rank r, e.g. gathered
    with ``dist.all_gather``); the inverse of :func:`shard_sequence` with the same ``zigzag``."""
    if not isinstance(chunks, (list, tuple)) or len(chunks) == 0:
        raise TypeError(f"chunks must be a non-empty list of torch.Tensor (one per rank), got {chunks!r:.80}")
    for i, c in enumerate(chunks):
        if not isinstance(c, torch.Tensor):
            raise TypeError(f"chunks[{i}] must be a torch.Tensor, got {type(c).__name__}")
    check_flags(zigzag=zigzag)
    dim = _check_dim(chunks[0], dim)
    shape0 = chunks[0].shape
    for i, c in enumerate(chunks):
        if c.shape != shape0:
            raise ValueError(
                f"chunks[{i}] must have the shape of chunks[0] ({list(shape0)}): every rank holds the "
                f"same number of tokens; got {list(c.shape)}"
            )
    if not zigzag:
        return torch.cat(list(chunks), dim=dim)
    n = shape0[dim]
    if n % 2 != 0:
        raise ValueError(
            f"chunks: zig-zag shards hold two equal chunks, so their length along dim {dim} must be even, got {n}"
        )
    c = n // 2
    first = [x.narrow(dim, 0, c) for x in chunks]
    second = [x.narrow(dim, c, c) for x in reversed(chunks)]
    return torch.cat(first + second, dim=dim)


# -- the checks of ring_attention and ulysses_attention --------------------------------------------


def check_local_args(name: str, q, k, v, sinks, *, window, causal, scale, layout, **flags) -> AttnSpec:
    """``flashsink.attention``'s checks of a rank's shards, its boolean ``flags``, and one sequence
    (self-attention): k's local length equals q's."""
    spec = validate_attention(q, k, v, sinks, window=window, causal=causal, scale=scale, layout=layout)
    check_flags(**flags)
    if spec.seq_kv != spec.seq_q:
        raise ValueError(
            f"k: local sequence length ({spec.seq_kv}) must equal q's ({spec.seq_q}); {name} shards one "
            f"sequence (self-attention) across the ranks"
        )
    return spec


def group_size_rank(name: str, group) -> tuple[int, int]:
    """The size of ``group`` (None: the default group) and this process's rank in it."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("group: torch.distributed is not initialized (call init_process_group first)")
    not_member = ValueError(
        "group: this process is not a member of the given process group (new_group gave it "
        f"GroupMember.NON_GROUP_MEMBER); call {name} only on the group's ranks"
    )
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise not_member
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise not_member
    return dist.get_world_size(group), rank


def gather_same_shapes(spec: AttnSpec, group, p: int, device, options=()) -> list:
    """Every rank's ``(B, S_local, H, H_kv, D, D_v)`` and ``options`` (numbers), gathered: ValueError on
    every rank at once unless the shapes are equal (else a collective would mismatch or hang). Returns
    each rank's options."""
    shapes = (spec.batch, spec.seq_q, spec.heads, spec.kv_heads, spec.head_dim, spec.head_dim_v)
    mine = torch.tensor([*shapes, *options], dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(p)]
    dist.all_gather(rows, mine, group=group)
    rows = [t.tolist() for t in rows]
    got = [tuple(int(x) for x in r[:6]) for r in rows]
    if any(s != got[0] for s in got):
        raise ValueError(
            "q: every rank must pass the same local shapes (equal sequence shards); got "
            f"(B, S_local, H, H_kv, D, D_v) per rank = {got}"
        )
    return [r[6:] for r in rows]
