"""Bin packing of documents into rows of a fixed length: pure functions on lengths.

- ``split_documents(lengths, row_length, oversize)``: every document as the pieces a row can
  hold (a document longer than a row is cut into pieces of ``row_length``, each its own
  document, or refused).
- ``best_fit_decreasing(sizes, capacity)``: pieces into bins, longest first, each into the bin
  it fills best. The bins' shape (how many, which sizes in each) depends only on the multiset
  of sizes: shuffling the pieces first changes which equal-sized pieces share a bin, never
  how many bins there are, so a packed epoch always has the same number of rows.
- ``pack_rows(lengths, row_length, ...)``: both, for an epoch order, with the number of rows
  made a multiple of the number of ranks (a piece moved out of the fullest row into a new row)
  so that every rank gets as many rows.
- ``fill(rows, row_length)``: the share of the slots that hold tokens; ``padded_fill_of`` the
  same for batches padded to their longest document.

A row is a tuple of pieces ``(document index, start, stop)``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = [
    "Piece",
    "Row",
    "OVERSIZE",
    "split_documents",
    "best_fit_decreasing",
    "pack_rows",
    "fill",
]

#: One piece of a document: ``(document index, start token, stop token)``.
Piece = tuple[int, int, int]
#: One packed row: its pieces, in order.
Row = tuple[Piece, ...]
#: What to do with a document longer than a row.
OVERSIZE = ("split", "refuse")


def split_documents(
    lengths: Sequence[int], row_length: int, oversize: str = "split"
) -> tuple[list[Piece], list[int]]:
    """The pieces of every document (empty documents dropped) and the indices of the documents
    that were split. ``oversize="refuse"`` raises a ValueError naming the documents too long."""
    if oversize not in OVERSIZE:
        raise ValueError(f"`oversize` must be one of {OVERSIZE}; got {oversize!r}.")
    too_long = [i for i, n in enumerate(lengths) if n > row_length]
    if too_long and oversize == "refuse":
        shown = ", ".join(f"#{i} ({lengths[i]} tokens)" for i in too_long[:5])
        raise ValueError(
            f"{len(too_long)} documents are longer than `row_length`={row_length}: {shown}"
            f"{' ...' if len(too_long) > 5 else ''}; raise `row_length` or pass oversize='split' "
            "(each piece is then trained as its own document)."
        )
    pieces: list[Piece] = []
    for i, n in enumerate(lengths):
        for start in range(0, n, row_length):
            pieces.append((i, start, min(n, start + row_length)))
    return pieces, too_long


def best_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``sizes`` packed into bins of ``capacity``: longest first (ties in the given
    order), each into the open bin with the least room that still holds it, else a new bin."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])  # stable: ties keep their order
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        size = sizes[i]
        if size > capacity:
            raise ValueError(f"a piece of {size} tokens does not fit a row of {capacity}.")
        at = bisect.bisect_left(room, (size, -1))
        if at < len(room):
            left, b = room.pop(at)
        else:
            left, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if left - size > 0:
            bisect.insort(room, (left - size, b))
    return bins


def pack_rows(
    lengths: Sequence[int],
    row_length: int,
    order: Sequence[int] | None = None,
    *,
    oversize: str = "split",
    multiple_of: int = 1,
) -> list[Row]:
    """Rows of at most ``row_length`` tokens holding every document once.

    ``order``: the documents' order before packing (a shuffle: it decides which documents of
    equal length share a row); ``multiple_of``: the number of rows is made a multiple of it
    (the ranks), by moving the last piece of the row with the most pieces into a new row, or
    (where every row holds one piece) by cutting the longest piece in two.
    """
    pieces, _ = split_documents(lengths, row_length, oversize)
    if order is not None:
        rank = {doc: k for k, doc in enumerate(order)}
        pieces.sort(key=lambda p: (rank[p[0]], p[1]))
    bins = best_fit_decreasing([stop - start for _, start, stop in pieces], row_length)
    rows: list[list[Piece]] = [[pieces[i] for i in b] for b in bins]
    while multiple_of > 1 and len(rows) % multiple_of:
        most = max(range(len(rows)), key=lambda r: (len(rows[r]), r))
        if len(rows[most]) > 1:
            rows.append([rows[most].pop()])
            continue
        longest = max(range(len(rows)), key=lambda r: (rows[r][0][2] - rows[r][0][1], r))
        doc, start, stop = rows[longest][0]
        if stop - start < 2:
            raise ValueError(
                f"{len(rows)} rows of one token cannot be shared by {multiple_of} ranks evenly."
            )
        cut = start + (stop - start) // 2
        rows[longest] = [(doc, start, cut)]
        rows.append([(doc, cut, stop)])
    return [tuple(r) for r in rows]


def padded_fill_of(lengths: Sequence[int], batch_size: int) -> float:
    """Tokens over slots when batches of ``batch_size`` documents (in the given order) are padded
    to their longest document."""
    slots = sum(
        max(lengths[i : i + batch_size]) * len(lengths[i : i + batch_size])
        for i in range(0, len(lengths), batch_size)
    )
    return sum(lengths) / slots if slots else 0.0


def fill(rows: Sequence[Row], row_length: int) -> float:
    """Tokens over slots (rows x ``row_length``)."""
    tokens = sum(stop - start for row in rows for _, start, stop in row)
    return tokens / (len(rows) * row_length) if rows else 0.0
