"""The precision standard of flashsink, and the helpers every test, ``flashsink check`` and the
benchmark use to apply it: the public facade of two modules.

- ``_precision.py``: the standard itself (its docstring states it): the gates
  :func:`check_precision` / :func:`assert_precision` (gate 1 and gate 2, ``precision="strict"``),
  :func:`check_fast` / :func:`assert_fast` (``precision="fast"``), :func:`judge_all`, their
  tolerances (:class:`Tolerance`, :func:`tolerance`) and :class:`PrecisionReport`;
- ``_cases.py``: the problems they judge: :func:`make_inputs`, :func:`case_id`, the reference's
  gradients (:func:`reference_grads`, :func:`reference_pair`) and :func:`compare_all`.
"""

from __future__ import annotations

from ._cases import CHUNK_SCORE_ELEMS, case_id, compare_all, make_inputs, reference_grads, reference_pair
from ._precision import (
    COMPOSED_MARGIN,
    FAST_FACTOR,
    FAST_MAX_FACTOR,
    GATE2_FACTOR,
    MAX_ABS_LIMIT,
    MIN_RATIO,
    PRECISIONS,
    TENSORS,
    TOLERANCES,
    PrecisionReport,
    Tolerance,
    assert_fast,
    assert_precision,
    check_fast,
    check_precision,
    dtype_name,
    judge_all,
    resolve_dtype,
    tolerance,
)

__all__ = [
    "MAX_ABS_LIMIT",
    "MIN_RATIO",
    "COMPOSED_MARGIN",
    "TOLERANCES",
    "Tolerance",
    "PrecisionReport",
    "FAST_FACTOR",
    "FAST_MAX_FACTOR",
    "GATE2_FACTOR",
    "TENSORS",
    "PRECISIONS",
    "CHUNK_SCORE_ELEMS",
    "assert_fast",
    "assert_precision",
    "case_id",
    "check_fast",
    "check_precision",
    "compare_all",
    "dtype_name",
    "judge_all",
    "make_inputs",
    "reference_grads",
    "reference_pair",
    "resolve_dtype",
    "tolerance",
]
