"""Progress bars for long work (evaluation, training steps, sweeps): tqdm's text bar, everywhere.

In a Jupyter kernel ``tqdm.auto`` would draw a widget instead, and an executed notebook (``qerl reproduce``,
papermill) keeps only a widget's first frame as its text ("0/2 steps"). A text bar's frames are all kept as
output and shown as one line updated in place (the notebook applies their carriage returns), ending on the last.
So the kit's own bars are text bars in a terminal and in a notebook alike.
"""

from __future__ import annotations


def progress_bar(**kwargs):
    """A ``tqdm`` text bar with ``kwargs``."""
    from tqdm.std import tqdm

    return tqdm(**kwargs)
