"""`qerl_lib.progress.progress_bar`: tqdm's text bar, whose last frame an executed notebook keeps."""
from __future__ import annotations

import io

import tqdm.std

from qerl_lib import progress


def test_the_kits_bars_are_text_bars_that_end_on_their_last_frame():
    out = io.StringIO()
    bar = progress.progress_bar(total=3, desc="steps", file=out)
    assert type(bar) is tqdm.std.tqdm
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert out.getvalue().rstrip().split("\r")[-1].startswith("steps: 100%")
