"""The benchmarks' fixed-width tables: one column spec, one formatter (``qerl bench gemm``, ``rollout``, ``train``).

A column is ``(key, format spec, width)``: the header is the key, right-aligned in ``width``; a
cell is ``format(value, spec)`` (``str(value)`` for an empty spec), ``-`` where the value is
missing or None. Rows are mappings (a dataclass row: ``dataclasses.asdict`` first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Column = tuple[str, str, int]  # (key, format spec, width)


def table_header(columns: Sequence[Column]) -> str:
    """The header line: every key right-aligned in its width."""
    return " ".join(f"{key:>{width}}" for key, _, width in columns)


def table_row(row: Mapping, columns: Sequence[Column]) -> str:
    """One row, cell by cell as the columns say."""
    cells = []
    for key, spec, width in columns:
        value = row.get(key)
        text = "-" if value is None else (format(value, spec) if spec else str(value))
        cells.append(f"{text:>{width}}")
    return " ".join(cells)


def format_table(rows: Sequence[Mapping], columns: Sequence[Column]) -> str:
    """Header, a rule of dashes as wide as the header, then one line per row."""
    head = table_header(columns)
    return "\n".join([head, "-" * len(head), *(table_row(row, columns) for row in rows)])
