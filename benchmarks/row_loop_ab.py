"""The per-row decode kernel's loop switches timed side by side on one GPU (issue 5; docs/perf-notes.md v70-v72):
hoisted chunk offsets (``ROW_HOISTED_OFFSETS``) and each chunk's scores taken a step ahead (``ROW_QK_AHEAD``).

    python benchmarks/row_loop_ab.py [--cases 32:128k:4,32:32k:1,128:32k:1] [--heads 16/1] [--json PATH]

Forms: the launch rule's pipeline with the shipped loop ("rule"), with hoisted offsets ("rule hoisted") and with
the scores a step ahead ("rule ahead", whose loop addresses its chunks by a scalar start as hoisted offsets do). The
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
SWITCHES = ("ROW_HOISTED_OFFSETS", "ROW_QK_AHEAD")
FORMS = {"rule": (False, False), "rule hoisted": (True, False), "rule ahead": (False, True)}  # name: SWITCHES' values


@contextlib.contextmanager
def form(name: str):
    """Inside: the ``SWITCHES`` as the form sets them; restored after."""
    saved = [getattr(SA, switch) for switch in SWITCHES]
    for switch, value in zip(SWITCHES, FORMS[name]):
        setattr(SA, switch, value)
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
    spec_decode_forms.FORMS = {name: dict(rows_together=False, _form=name) for name in FORMS}
    op = SA.sparse_attn_decode
    SA.sparse_attn_decode = decode_in_form
    try:
        spec_decode_forms.main(argv + ["--forms", ",".join(FORMS)])
    finally:
        SA.sparse_attn_decode = op


if __name__ == "__main__":
    main()
