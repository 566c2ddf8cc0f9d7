"""The per-row decode kernel with its chunk offsets hoisted (``ROW_HOISTED_OFFSETS``) against the shipped loop, timed
side by side on one GPU (issue 5; docs/perf-notes.md v70-v72).

    python benchmarks/row_loop_ab.py [--cases 32:128k:4,32:32k:1,128:32k:1] [--heads 16/1] [--json PATH]

Forms: the launch rule's pipeline with the shipped loop ("rule") and with hoisted offsets ("rule hoisted"). The
rule walks whole blocks at one program per SM and half blocks where the grid is an even number of waves (e.g.
``--heads 64/4 --cases 128:32k:1``). Timing, rotation, rounds and the output check are ``spec_decode_forms``'s
(the first form is the diffs' reference).
"""
from __future__ import annotations

import contextlib
import os
import sys

import m3sparse.kernels.sparse_attn as SA

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spec_decode_forms  # noqa: E402

DEFAULT_CASES = "32:128k:4,32:32k:1,128:32k:1"  # criterion 4's, criterion 5's, one wave of one split per row
FORMS = {"rule": False, "rule hoisted": True}  # name: hoisted chunk offsets


@contextlib.contextmanager
def form(name: str):
    """Inside: ``ROW_HOISTED_OFFSETS`` as the form sets it; restored after."""
    saved = SA.ROW_HOISTED_OFFSETS
    SA.ROW_HOISTED_OFFSETS = FORMS[name]
    try:
        yield
    finally:
        SA.ROW_HOISTED_OFFSETS = saved


DECODE = SA.sparse_attn_decode


def decode_in_form(*args, _form: str, **kwargs):
    with form(_form):
        return DECODE(*args, **kwargs)


def main(argv=None) -> None:
    argv = list(argv if argv is not None else sys.argv[1:])
    if "--cases" not in argv:
        argv = ["--cases", DEFAULT_CASES] + argv
    spec_decode_forms.FORMS = {name: dict(rows_together=False, _form=name) for name in FORMS}
    op = SA.sparse_attn_decode
    SA.sparse_attn_decode = decode_in_form
    try:
        spec_decode_forms.main(argv + ["--forms", ",".join(FORMS)])
    finally:
        SA.sparse_attn_decode = op


if __name__ == "__main__":
    main()
