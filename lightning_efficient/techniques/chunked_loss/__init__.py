"""Cross-entropy without the full logits, on an unmodified model (see docs/chunked_cross_entropy.md).

- :mod:`.kernel`: ``chunked_linear_cross_entropy``, the pure-PyTorch chunked loss (a custom
  autograd Function).
- :mod:`.backends`: which implementation runs a call (this package's, Liger-Kernel's, Cut
  Cross-Entropy's), a pure rule.
- :mod:`.lazy`: ``LazyLogits``, what the output projection returns while training.
- :mod:`.apply`: ``apply_chunked_cross_entropy`` and how the output projection is found.
- :mod:`.callback`: ``ChunkedCrossEntropy``, the callback.
"""

from lightning_efficient.techniques.chunked_loss.apply import (
    LossSession,
    apply_chunked_cross_entropy,
    find_output_projection,
    loss_refusal,
    worth_chunking,
)
from lightning_efficient.techniques.chunked_loss.backends import BACKENDS, choose_backend
from lightning_efficient.techniques.chunked_loss.callback import ChunkedCrossEntropy
from lightning_efficient.techniques.chunked_loss.kernel import (
    DEFAULT_CHUNK_BYTES,
    chunk_rows,
    chunked_linear_cross_entropy,
)
from lightning_efficient.techniques.chunked_loss.lazy import LazyLogits

__all__ = [
    "BACKENDS",
    "DEFAULT_CHUNK_BYTES",
    "ChunkedCrossEntropy",
    "LazyLogits",
    "LossSession",
    "apply_chunked_cross_entropy",
    "choose_backend",
    "chunk_rows",
    "chunked_linear_cross_entropy",
    "find_output_projection",
    "loss_refusal",
    "worth_chunking",
]
