"""Write a notebook from a compact list of ("md"|"code"|"params", source) cells, output-free.

An authoring helper for notebooks/NN_*.ipynb; the .ipynb files are the committed source of truth.
Usage from Python: `from tools.nb import write_notebook; write_notebook(path, cells)`.
"""

from __future__ import annotations

import nbformat


def write_notebook(path, cells) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "qerl-kit", "display_name": "QeRL kit (.venv)", "language": "python"}  # make lab
    nb.metadata["language_info"] = {"name": "python"}
    for kind, src in cells:
        src = src.strip("\n")
        if kind == "md":
            nb.cells.append(nbformat.v4.new_markdown_cell(src))
        elif kind == "code":
            nb.cells.append(nbformat.v4.new_code_cell(src))
        elif kind == "params":
            cell = nbformat.v4.new_code_cell(src)
            cell.metadata["tags"] = ["parameters"]
            nb.cells.append(cell)
        else:
            raise ValueError(kind)
    for c in nb.cells:  # deterministic ids keep diffs small
        c.pop("id", None)
    nb.nbformat_minor = 4
    nbformat.validate(nb)
    nbformat.write(nb, path)
