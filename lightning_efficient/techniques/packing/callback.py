"""``SequencePacking``: the callback that decides when the train loader is packed and the
attention kept inside each document; the maths is in ``bins``, ``rows``, ``sampler`` and
``attention``."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_efficient.core.change import Change, patch_attribute
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import SettingsError, check_bool, check_choice, check_int
from lightning_efficient.measure.scratch import scratch
from lightning_efficient.measure.step import run_step
from lightning_efficient.techniques._loader_source import loader_source
from lightning_efficient.techniques.curriculum.difficulty import check_seed
from lightning_efficient.techniques.packing.attention import (
    DocumentAttention,
    apply_document_attention,
    hf_models,
    packing_error,
)
from lightning_efficient.techniques.packing.bins import OVERSIZE, fill, padded_fill_of
from lightning_efficient.techniques.packing.sampler import (
    MAX_TOKEN_ID,
    PackedRowSampler,
    document_lengths,
    items_of,
    pack_dataloader,
)

__all__ = ["SequencePacking"]

_FALLBACK = "use LengthBucketSampler instead (similar lengths share a batch; no masking needed)"


class SequencePacking(Technique):
    """Pack variable-length documents into rows of a fixed length, each token attending only
    within its own document: the slots padding wasted become tokens (see docs/packing.md).

    The fit's train loader (from the datamodule's or module's ``train_dataloader`` or given to
    ``trainer.fit``) is wrapped for the fit: its map-style dataset of items with ``input_ids``
    (optionally ``labels``; its ``collate_fn`` applied per document) is served as packed rows
    (``PackedRowSampler``: best-fit decreasing, shuffled per epoch, sharded over the ranks, the
    same number of batches every epoch) of dicts with ``input_ids``, ``labels`` (-100 on padding
    and where a target would cross a document boundary) and ``position_ids`` (restarting at 0
    per document). When fit starts the attention path is chosen (Hugging Face models: restarting
    ``position_ids``; other modules: a document mask on ``F.scaled_dot_product_attention``) and,
    before training, checked: the user's ``training_step`` on one packed row must give the token
    mean of its documents run one by one, or the fit stops saying why. The loss stays the
    module's own (a token mean over the labels that are not -100). The packer's position is in
    the checkpoint: a run resumed mid-epoch continues with the same rows. A sampler that picks
    documents, manual optimization (with ``check``) and ``Curriculum``/``DevicePreload`` are
    refused, naming them.

    Args:
        row_length: Tokens in a row (None: the longest document).
        rows_per_batch: Rows in a batch (None: the loader's ``batch_size``).
        seed: Seed of the per-epoch shuffles.
        oversize: ``"split"`` (a document longer than a row becomes pieces, each its own
            document; said once) or ``"refuse"`` (the fit stops naming them).
        pad_id: Token id of the padding that ends a row.
        shifted_labels: The items' ``labels`` are already the next tokens (then no target is
            masked at a document boundary).
        check: Check before training that the documents are kept apart (the check above).
    """

    stacks = False
    orders_samples = packs_documents = True  # read by the compatibility rules

    def __init__(
        self,
        row_length: int | None = None,
        rows_per_batch: int | None = None,
        seed: int = 0,
        oversize: str = "split",
        pad_id: int = 0,
        shifted_labels: bool = False,
        check: bool = True,
    ) -> None:
        super().__init__()
        self.row_length = check_int("row_length", row_length, minimum=2, allow_none=True)
        self.rows_per_batch = check_int(
            "rows_per_batch", rows_per_batch, minimum=1, allow_none=True
        )
        self.seed = check_seed(seed)
        self.oversize = check_choice("oversize", oversize, OVERSIZE)
        self.pad_id = check_int("pad_id", pad_id, minimum=0, maximum=MAX_TOKEN_ID)
        self.shifted_labels = check_bool("shifted_labels", shifted_labels)
        self.check = check_bool("check", check)
        self.sampler: PackedRowSampler | None = None
        self.loader: DataLoader | None = None
        self.session: DocumentAttention | None = None
        self._wrapped = Change("train_dataloader not wrapped")
        self._attention = Change("attention not changed")
        self._state: dict[str, Any] | None = None
        self._trainer: Callable[[], Any] = lambda: None
        self._figures: dict[str, Any] = {}
        self._what = ""

    # -- the loader -----------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit" or not self._wrapped.undone:
            return
        self.sampler, self.loader, self.session, self._state = None, None, None, None
        self._trainer = weakref.ref(trainer)
        source = loader_source(trainer, pl_module)  # module, datamodule or fit's loaders
        if source is None:
            self.no_effect("the fit has no train DataLoader to pack.")
            return
        owner, hook = source
        original = getattr(owner, hook)
        self._wrapped = self.record(
            trainer, patch_attribute(owner, hook, lambda: self._install(original()))
        )

    def _install(self, loader: Any) -> Any:
        why = _unpackable(loader)
        if why is not None:
            self.no_effect(f"the train loader is left as it is: {why}")
            return loader
        try:
            lengths = document_lengths(items_of(loader))
            new = pack_dataloader(
                loader, self.row_length or max(lengths), rows_per_batch=self.rows_per_batch,
                seed=self.seed, oversize=self.oversize, pad_id=self.pad_id,
                shifted_labels=self.shifted_labels, lengths=lengths,
            )  # fmt: skip
            state = self.state_dict() if self.sampler is not None else self._state
            if state:
                new.sampler.load_state_dict(state)
        except (TypeError, ValueError) as err:
            raise SettingsError(f"{self.name}: {err}") from err
        self.sampler, self.loader = new.sampler, new
        self._describe(loader, lengths, new)
        return new

    def _describe(self, loader: DataLoader, lengths: list[int], new: DataLoader) -> None:
        s = self.sampler
        size = loader.batch_size or 1
        padded_fill, packed_fill = (
            padded_fill_of(lengths, size),
            fill(s.global_rows(0), s.row_length),
        )
        self._figures = dict(
            documents=len(lengths), rows=len(s) * s.num_replicas, row_length=s.row_length,
            fill=round(packed_fill, 4), padded_fill=round(padded_fill, 4), split_documents=len(s.split),
        )  # fmt: skip
        self._what = (
            f"{len(lengths)} documents packed into {self._figures['rows']} rows of {s.row_length} "
            f"tokens, {new.batch_size} a batch: {packed_fill:.1%} of the slots are tokens "
            f"(padded batches of {size}: {padded_fill:.1%})"
        )
        if s.split:
            self.note(f"{len(s.split)} documents longer than {s.row_length} tokens were split")
        self.note(self._what)

    # -- attention ------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._wrapped.undone:
            return
        if self.check and not pl_module.automatic_optimization:
            raise SettingsError(
                f"{self.name}: the check that documents are kept apart runs `training_step`, "
                "which under manual optimization would step the optimizers: check the packed "
                "loss yourself and pass check=False, or use automatic optimization."
            )
        _check_pad_id(self.pad_id, pl_module)
        self._attention = self.record(trainer, apply_document_attention(pl_module))
        self.session = self._attention.value
        self.note(f"attention path {self.session.path!r}: {self._attention.what}")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.sampler is None and self.session is not None:  # nothing packed: nothing to serve
            self._attention.undo()
            self.session = None
        if self.sampler is None or self.session is None or not self.check:
            return
        row = next((r for r in self.sampler.rank_rows(0) if len(r) > 1), None)
        if row is None:
            return  # every row holds one document: nothing to keep apart
        error = _check(trainer, pl_module, self.loader.dataset, row, self.session)
        tolerance = 1e-5 if str(trainer.precision).startswith("32") else 2e-2
        if error > tolerance:
            raise SettingsError(
                f"{self.name}: the loss of a packed row of {len(row)} documents differs from the "
                f"token mean of the same documents run one by one by {error:.2e} (relative; "
                f"allowed {tolerance:g}), so the documents would be mixed or the loss is not a "
                f"token mean. Path tried: {self.session.path!r}; a module with its own attention "
                "kernel, positions computed in its forward or F.scaled_dot_product_attention "
                f"imported under another name cannot be served: {_FALLBACK}."
            )
        self._figures["check_error"] = error
        self.session.served = 0  # the report counts the training's calls, not the check's

    # -- driving it ----------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.session is not None and isinstance(batch, dict):
            self.session.current(batch.get("position_ids"), batch.get("input_ids"))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.session is not None:
            self.session.current(None)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.sampler is not None and self.session is not None:
            self._figures.update(path=self.session.path, served_calls=self.session.served)
            self.report(trainer, f"{self._what}; attention: {self.session.path}", **self._figures)
        elif self._wrapped.undone or self.sampler is None:
            self.report(trainer, "not packed (see the warning)", packed=False)
        super().on_fit_end(trainer, pl_module)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer()
        if self.sampler is None or self.loader is None or trainer is None:
            return dict(self._state or {})
        return {"seed": self.sampler.seed, **_position(trainer, self.loader)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = dict(state_dict)


def _position(trainer: Any, loader: DataLoader) -> dict[str, int]:
    """The packer's place as Lightning's loops count it (so whatever the order of the callbacks
    that save): ``epoch`` and ``position``, the rows of the epoch's batches whose step is done;
    a finished epoch is the next one at 0."""
    epochs, batches = trainer.fit_loop.epoch_progress.current, 0
    epoch = epochs.processed
    if epochs.processed < epochs.started:  # inside epoch `epoch`
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if batches >= min(len(loader), trainer.num_training_batches):
            epoch, batches = epoch + 1, 0
    return {"epoch": epoch, "position": batches * (loader.batch_size or 1)}


def _check_pad_id(pad_id: int, module: Any) -> None:
    """``pad_id`` must be a token of the Hugging Face models' vocabularies (their input
    embeddings' rows), or the first padded row fails with a bare index error."""
    for name, hf in hf_models(module):
        rows = hf.get_input_embeddings().num_embeddings
        if pad_id >= rows:
            raise SettingsError(
                f"SequencePacking: `pad_id` must be a token id below the vocabulary of "
                f"`{name or type(hf).__name__}` ({rows} tokens); got {pad_id}."
            )


def _unpackable(loader: Any) -> str | None:
    from torch.utils.data import IterableDataset

    if not isinstance(loader, DataLoader):
        return f"train_dataloader() returned a {type(loader).__name__}, not a DataLoader"
    if isinstance(loader.dataset, IterableDataset) or not hasattr(loader.dataset, "__len__"):
        return "its dataset is iterable-style (packing needs map-style items with input_ids)"
    if len(loader.dataset) == 0:
        return "its dataset is empty"
    try:
        item = items_of(loader)[0]
    except ValueError as err:  # a sampler or batch sampler packing would drop
        raise SettingsError(f"SequencePacking: {err}") from err
    except TypeError as err:  # a collate_fn whose batches are not dicts of input_ids
        return str(err)
    if not isinstance(item, dict) or "input_ids" not in item:
        return f"its items are {type(item).__name__}s, not dicts with `input_ids`"
    return None


def _check(trainer: Any, module: Any, data: Any, row: Any, session: Any) -> float:
    """``packing_error`` of ``row`` (and of its documents alone) through the user's training
    step, on the device: no gradients, dropout off, logging silenced, and the module put back as
    after every measurement (``measure.scratch.scratch``: its attributes, buffers, metric states,
    modes and the RNG)."""

    def batch(key: Any) -> Any:
        return trainer.strategy.batch_to_device({k: v[None] for k, v in data[key].items()})

    packed, alone = batch(row), [batch((piece,)) for piece in row]
    with scratch(module, train=False), torch.no_grad(), trainer.precision_plugin.forward_context():
        return packing_error(lambda b: run_step(module, b), packed, alone, session)
