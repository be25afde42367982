"""Sequence packing: variable-length documents in rows of a fixed length, without padding.

Pure parts: ``bins`` (best-fit decreasing on lengths), ``rows`` (one row and its
``position_ids``/labels/document mask), ``sampler`` (the packer: ``PackedRowSampler``,
``pack_dataloader``), ``attention`` (keeping each document's attention inside it); the thin
callback ``SequencePacking``. See docs/packing.md.
"""

from lightning_efficient.techniques.packing.attention import (
    DocumentAttention,
    apply_document_attention,
    packing_error,
)
from lightning_efficient.techniques.packing.bins import best_fit_decreasing, fill, pack_rows
from lightning_efficient.techniques.packing.callback import SequencePacking
from lightning_efficient.techniques.packing.rows import (
    build_row,
    cu_seqlens,
    document_ids,
    document_mask,
)
from lightning_efficient.techniques.packing.sampler import (
    PackedDocuments,
    PackedRowSampler,
    document_lengths,
    pack_dataloader,
)

__all__ = [
    "SequencePacking",
    "PackedRowSampler",
    "PackedDocuments",
    "pack_dataloader",
    "document_lengths",
    "apply_document_attention",
    "DocumentAttention",
    "packing_error",
    "best_fit_decreasing",
    "pack_rows",
    "fill",
    "build_row",
    "document_ids",
    "document_mask",
    "cu_seqlens",
]
