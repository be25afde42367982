"""``ChunkedCrossEntropy``: the callback that decides when the loss is computed from chunks."""

from __future__ import annotations

from typing import Any

from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import SettingsError, check_choice, parse_bytes
from lightning_efficient.techniques.chunked_loss import backends
from lightning_efficient.techniques.chunked_loss.apply import (
    apply_chunked_cross_entropy,
    find_output_projection,
    loss_refusal,
)
from lightning_efficient.techniques.chunked_loss.kernel import LOGITS_FRACTION

__all__ = ["ChunkedCrossEntropy"]

_MIN_CHUNK = 2**16


class ChunkedCrossEntropy(Technique):
    """Cross-entropy from the last hidden states and the output projection, in chunks of rows:
    the full logits and their gradient never exist (same maths; the model is unchanged).

    While training, the output projection returns lazy logits; ``F.cross_entropy`` on them (what
    a Hugging Face causal LM's ``loss_function`` calls, and what a plain module's
    ``training_step`` calls) computes the loss chunk by chunk, with the gradients of the hidden
    states and of the weight formed in the same pass. Label shift, ``ignore_index``, mean over
    the tokens not ignored (or Hugging Face's ``num_items_in_batch`` sum), label smoothing and
    autocast are as in the plain step. A training step that reads the logits otherwise (a
    metric) gets the full logits for that step, and the callback says so once. Validation
    (no grad) is untouched. See docs/chunked_cross_entropy.md.

    Args:
        head: Name of the output projection (an ``nn.Linear`` of the LightningModule, e.g.
            ``"model.lm_head"``, or ``"model.lm_head.linear"`` in ``litgpt.lora.GPT``);
            ``None``: the output head by the package's one rule (``measure.memory.heads``: a Hugging
            Face model's output embeddings, else a linear layer tied to an embedding, else one
            as wide as the largest embedding; in a model without embeddings, the last linear
            layer). A name that is no ``nn.Linear`` of the module is refused when fit starts.
        backend: ``"auto"`` (Liger-Kernel, then Cut Cross-Entropy, when installed and the step
            runs on CUDA; this package's chunked implementation otherwise), ``"chunked"``,
            ``"liger"`` or ``"cce"`` (the library asked for; the chunked implementation where it
            cannot compute the call, e.g. on a CPU).
        chunk_bytes: The largest float32 logits of one chunk (bytes or a string like
            ``"128MiB"``; at least 64 KiB). Rows per chunk: 1/16 of the logits' rows (at least
            16), and never more than ``chunk_bytes / (4 * vocabulary)`` (``kernel.chunk_rows``).

    The projection is changed when fit starts and put back after fit, and when fit raises or is
    interrupted; ``state_dict`` keys never change. A model whose configuration transforms its
    logits before the loss (soft-capping, a logit scale, a z-loss) is refused when fit starts.
    """

    stacks = False
    trains_without_cache = True
    uses_parameters_after_call = True

    def __init__(
        self,
        head: str | None = None,
        backend: str = "auto",
        chunk_bytes: int | str = "128MiB",
    ) -> None:
        super().__init__()
        if head is not None and (not isinstance(head, str) or not head):
            raise TypeError(
                "`head` must be the name of the output projection (a non-empty string, e.g. "
                f"'model.lm_head') or None; got {head!r} ({type(head).__name__})."
            )
        self.head = head
        self.backend = check_choice("backend", backend, backends.BACKENDS)
        size = parse_bytes("chunk_bytes", chunk_bytes)
        if size < _MIN_CHUNK:
            raise ValueError(
                f"`chunk_bytes` must be at least 64 KiB (a chunk of a few rows); got {chunk_bytes!r}."
            )
        self.chunk_bytes = chunk_bytes
        self._bytes = size
        self._change: Change | None = None

    # -- the estimate -------------------------------------------------------------------------
    def configure_estimate(self, plan: Any) -> None:
        """Make the estimated steps compute the loss from chunks (the chunked backend: the
        library kernels need CUDA, and the estimate's tensors are fake CPU tensors)."""
        change = self._apply(plan.model, say=plan.note)
        plan.record(change)
        cap = self._bytes // (4 * change.figures["vocabulary"])
        rows = f"1/{LOGITS_FRACTION} of the rows a chunk, {cap:,} at most"
        plan.note(f"{self.name}: {change.what} ({rows}; the chunked backend)")

    # -- hooks ----------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.backend in backends.LIBRARIES:
            backends.check_library(self.backend)
        refusal = loss_refusal(pl_module)
        if refusal is not None:
            raise SettingsError(f"{self.name}: {refusal}")
        find_output_projection(pl_module, self.head)  # `head=` checked before anything runs

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._change = self.record(trainer, self._apply(pl_module, say=self.no_effect))
        available = [n for n, ok in self._change.value.available.items() if ok]
        libraries = f"installed: {', '.join(available)}" if available else "no library installed"
        self.note(f"{self._change.what} (backend {self.backend!r}; {libraries})")

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._change is not None:
            self._report(trainer, self._change)
        super().on_fit_end(trainer, pl_module)

    # -- helpers ----------------------------------------------------------------------------
    def _apply(self, model: Any, say: Any) -> Change:
        return apply_chunked_cross_entropy(
            model, head=self.head, backend=self.backend, chunk_bytes=self._bytes, say=say
        )

    def _report(self, trainer: Any, change: Change) -> None:
        session = change.value
        chunked, fell_back = session.chunked_calls, session.fallback_calls
        if not chunked:
            name, _, how = find_output_projection(trainer.lightning_module, self.head)
            self.no_effect(
                f"no training loss was computed from chunks: the logits of `{name}` ({how}) never "
                "reached F.cross_entropy as (N, vocabulary) logits with class indices"
                + (f"; they were used by {', '.join(session.fallbacks)}" if fell_back else "")
                + ". Name the output projection with `head=` if it is another layer."
            )
        used = ", ".join(f"{b} x{n}" for b, n in session.by_backend.items()) or "none"
        rows = f" of {session.rows:,} rows" if session.rows else ""
        self.report(
            trainer,
            f"{change.what}{rows}: {chunked} of {chunked + fell_back} training losses "
            f"(backend: {used}; {session.why or 'no call'})",
            losses_from_chunks=chunked,
            full_logits_steps=fell_back,
            rows_per_chunk=session.rows,
        )
