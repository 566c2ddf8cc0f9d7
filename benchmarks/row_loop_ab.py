"""The per-row decode kernel's loop switches timed side by side on one GPU (issue 5; docs/perf-notes.md v70, v71):
hoisted chunk offsets (``ROW_HOISTED_OFFSETS``), the softmax on exp2 (``ROW_EXP2``, against ``tl.exp``) and the row
sums after the loop (``ROW_LATE_SUM``, against a sum per chunk).

    python benchmarks/row_loop_ab.py [--cases 32:128k:4,32:32k:1,128:32k:1] [--heads 16/1] [--json PATH]

Forms: the launch rule's pipeline ("rule"), two splits of 64-key chunks in three stages ("x2 64k3", two programs
per SM at criterion 4's case) and eight such splits ("x8 64k3"), each with the switches its name gives: none named,
the shipped ones (exp2 and late sums); "v70", none of the three (the loop v70 timed); "exp", late sums on
``tl.exp``; "hoisted", all three. Timing, rotation, rounds and the output check are ``spec_decode_forms``'s (the
first form is the diffs' reference).
"""
from __future__ import annotations

import contextlib
import os
import sys

import m3sparse.kernels.sparse_attn as SA

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spec_decode_forms  # noqa: E402

DEFAULT_CASES = "32:128k:4,32:32k:1,128:32k:1"  # criterion 4's, criterion 5's, one wave of one split per row
# name: (splits or None for the rule's, (keys per chunk, stages) or None for the rule's, hoisted offsets, exp2,
# late row sums)
FORMS = {"rule": (None, None, False, True, True), "rule v70": (None, None, False, False, False),
         "rule exp": (None, None, False, False, True), "rule hoisted": (None, None, True, True, True),
         "x2 64k3 v70": (2, (64, 3), False, False, False), "x2 64k3 hoisted": (2, (64, 3), True, True, True),
         "x8 64k3 hoisted": (8, (64, 3), True, True, True)}
SWITCHES = ("_row_pipeline", "ROW_HOISTED_OFFSETS", "ROW_EXP2", "ROW_LATE_SUM")


@contextlib.contextmanager
def form(name: str):
    """Inside: the ``SWITCHES`` as the form sets them; restored after."""
    _, pipe, *flags = FORMS[name]
    saved = [getattr(SA, switch) for switch in SWITCHES]
    for switch, value in zip(SWITCHES[1:], flags):
        setattr(SA, switch, value)
    if pipe is not None:
        SA._row_pipeline = lambda *args, **kwargs: pipe
    try:
        yield
    finally:
        for switch, value in zip(SWITCHES, saved):
            setattr(SA, switch, value)


DECODE = SA.sparse_attn_decode


def decode_in_form(*args, _form: str, **kwargs):
    with form(_form):
        return DECODE(*args, **kwargs)


def main(argv=None) -> None:
    argv = list(argv if argv is not None else sys.argv[1:])
    if "--cases" not in argv:
        argv = ["--cases", DEFAULT_CASES] + argv
    spec_decode_forms.FORMS = {name: dict(rows_together=False, _form=name, **({"splits": splits} if splits else {}))
                               for name, (splits, *_) in FORMS.items()}
    op = SA.sparse_attn_decode
    SA.sparse_attn_decode = decode_in_form
    try:
        spec_decode_forms.main(argv + ["--forms", ",".join(FORMS)])
    finally:
        SA.sparse_attn_decode = op


if __name__ == "__main__":
    main()
