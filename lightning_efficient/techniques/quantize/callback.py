"""``FrozenWeights4bit``: the callback that decides when frozen weights are stored in 4 bits."""

from __future__ import annotations

from typing import Any

from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_choice
from lightning_efficient.techniques.quantize.adapters import (
    apply_frozen_base_loading,
    trainable_state,
)
from lightning_efficient.techniques.quantize.weights import (
    QUANT_TYPES,
    apply_frozen_weights_4bit,
    check_blocksize,
    compute_dtype_for,
    patterns,
)

__all__ = ["FrozenWeights4bit"]


class FrozenWeights4bit(Technique):
    """Store the frozen weights of the module's linear layers in 4 bits (QLoRA's NF4 with double
    quantization, bitsandbytes), computing in the trainer's precision. For fine-tuning with
    adapters (PEFT LoRA, LitGPT LoRA) or a frozen backbone with a trainable head: the frozen
    weights, most of the memory, take about 0.52 bytes per weight instead of 2 (bf16) or 4.

    Trainable weights, adapters, weights tied to another module and the output head are left as
    they are. The layers keep their class and ``state_dict`` keys: a checkpoint holds the
    original weights (kept in host memory for the undo), loads without this callback, and a
    resume quantizes them again. The weights are stored in 4 bits when fit starts and put back
    bit-exactly after fit (also when it raises). Hugging Face models train without their
    key/value cache. Served under DDP (each rank quantizes its replica alike); refused under
    FSDP and DeepSpeed, which shard or flatten the weights. See docs/quantize.md.

    Args:
        quant_type: ``"nf4"`` (NormalFloat4, QLoRA's) or ``"fp4"``.
        double_quant: Quantize the block scales too (saves about 0.4 bits per weight).
        blocksize: Weights per scale: 64 (QLoRA's), 128, 256, ... 4096.
        modules: Names or ``fnmatch`` patterns of the layers to store in 4 bits (``None``:
            every frozen ``nn.Linear``); naming a layer whose weight is trainable is refused
            when fit starts.
        skip: Names or patterns of layers kept in full precision.
        save_frozen: Checkpoints hold the frozen weights too (``True``: the whole model, as
            without this callback). ``False``: the trainable state only (adapters, a head, the
            buffers), the frozen weights listed with a fingerprint: a checkpoint the size of the
            adapters. A resume with this callback reads the frozen weights from the module as
            built (its pretrained files) and checks them against the fingerprints; without it,
            build the module and load with ``strict=False``.
    """

    quantizes_frozen_weights = True
    stacks = False
    trains_without_cache = True
    sharding_conflict = (
        "4-bit weights are packed uint8 tensors with their scales beside them, which a sharding "
        "strategy would split or flatten; use DDP or a single device"
    )

    def __init__(
        self,
        quant_type: str = "nf4",
        double_quant: bool = True,
        blocksize: int = 64,
        modules: list[str] | None = None,
        skip: list[str] | None = None,
        save_frozen: bool = True,
    ) -> None:
        super().__init__()
        self.quant_type = check_choice("quant_type", quant_type, QUANT_TYPES)
        self.double_quant = check_bool("double_quant", double_quant)
        self.blocksize = check_blocksize(blocksize)
        self.modules = patterns("modules", modules, allow_none=True)
        self.skip = patterns("skip", [] if skip is None else skip, allow_none=False)
        self.save_frozen = check_bool("save_frozen", save_frozen)
        self._change: Change | None = None

    # -- the estimate -------------------------------------------------------------------------
    def configure_estimate(self, plan: Any) -> None:
        """Store the estimated model's frozen weights in 4 bits as the fit will (fake tensors:
        the packed weights, their scales and the dequantized temporaries are counted)."""
        change = self._apply(plan.model, compute_dtype_for(plan.precision))
        plan.record(change)
        plan.note(f"{self.name}: {change.what}")

    # -- hooks ----------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        # before Lightning restores a checkpoint: one that holds the trainable state only loads
        self.record(trainer, apply_frozen_base_loading(pl_module))

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        if not self.save_frozen:
            checkpoint["state_dict"] = trainable_state(pl_module, checkpoint["state_dict"])

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        change = self._apply(pl_module, compute_dtype_for(trainer.precision))
        self._change = self.record(trainer, change)
        if not change.figures["layers_4bit"]:
            left = change.value.left
            reasons = sorted(set(left.values()))
            self.no_effect(
                f"{change.what}: {len(left)} linear layers left as they are ({'; '.join(reasons)})"
                if left
                else f"{change.what}: the module has no nn.Linear or Conv1D layer"
            )
        else:
            self.note(self._line(change))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._change is not None:
            self.report(trainer, self._line(self._change), **self._change.figures)
        super().on_fit_end(trainer, pl_module)

    # -- helpers ----------------------------------------------------------------------------
    def _apply(self, model: Any, compute_dtype: Any) -> Change:
        return apply_frozen_weights_4bit(
            model,
            compute_dtype=compute_dtype,
            quant_type=self.quant_type,
            double_quant=self.double_quant,
            blocksize=self.blocksize,
            modules=self.modules,
            skip=self.skip,
        )

    @staticmethod
    def _line(change: Change) -> str:
        before, after = change.figures["weight_bytes_before"], change.figures["weight_bytes_after"]
        if not before:
            return change.what
        return f"{change.what}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB ({after / before:.2f}x)"
