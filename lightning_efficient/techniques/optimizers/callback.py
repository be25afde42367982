"""``OptimizerSwap``: the thin callback that decides *when* to swap the module's optimizers (in
``on_fit_start``, after Lightning created them and before it restores their state on resume)."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_choice
from lightning_efficient.measure.memory.optimizer_models import (
    optimizer_class,
    optimizer_state_bytes,
)
from lightning_efficient.techniques.optimizers.bf16 import check_low_precision_weights
from lightning_efficient.techniques.optimizers.build import (
    apply_optimizer_swap,
    estimate_optimizer,
    kept_32bit_parameters,
    merge_overrides,
    set_device_flags,
    swap_messages,
)
from lightning_efficient.techniques.optimizers.checkpoint import (
    make_portable,
    reconcile_optimizer_states,
    swap_entry,
)

__all__ = ["OptimizerSwap"]


class OptimizerSwap(Technique):
    """Replace the optimizers that the module's ``configure_optimizers`` created by a memory-lean
    one, keeping param groups (per-group lr, weight decay, options), LR schedulers (with their
    interval, frequency and monitor) and multiple optimizers.

    Args:
        name: ``"adamw8bit"``, ``"adam8bit"``, ``"paged_adamw8bit"``, ``"paged_adamw32bit"``,
            ``"lion8bit"`` (bitsandbytes), ``"adafactor"`` (``torch.optim.Adafactor``),
            ``"adamw_fused"`` (fused AdamW on CUDA, foreach AdamW on CPU), the bf16-weight names
            ``"adamw_kahan"`` (Kahan-compensated AdamW, torch-optimi), ``"adamw_sr"`` and
            ``"adamw8bit_sr"`` (AdamW / 8-bit AdamW with stochastic rounding, torchao) for
            ``Trainer(precision="bf16-true")`` (refused on 32-bit weights; see
            :mod:`~lightning_efficient.techniques.optimizers.bf16`), or the class path of any
            ``torch.optim.Optimizer``.
        overrides: Constructor arguments of the new optimizer that replace the carried values in
            every group (e.g. ``{"lr": 1e-2}``, ``{"min_8bit_size": 16384}``). From yaml, give them
            here; from Python they may also be passed as keyword arguments. Values the optimizer
            would refuse are refused here, naming the key (``lr`` and ``weight_decay`` finite and
            ``>= 0``, ``betas`` in ``[0, 1)``, ``eps`` finite and ``> 0``, ...).
        optimizer_in_backward: Step each parameter from its post-accumulate-grad hook and free its
            gradient at once (no full set of gradients in memory). Refused with gradient
            accumulation, gradient clipping, 16-mixed precision and multi-process training.
        embeddings_32bit: For 8-bit names, keep 32-bit states for ``nn.Embedding`` weights
            (bitsandbytes' GlobalOptimManager override). Tensors under ``min_8bit_size``
            (default 4096 elements) keep 32-bit states anyway.
        on_mismatch: What to do when resuming from a checkpoint whose optimizer state was written
            by another optimizer: ``"error"`` (default: stop with the choices) or ``"reset"``
            (start the new optimizer's state afresh; the learning rates are kept).
        **kwargs: More ``overrides``.

    Checkpoints: the swapped optimizer's state is stored in this callback's checkpoint entry and
    restored exactly on resume with the same swap. The checkpoint's ``optimizer_states`` holds a
    state the module's own optimizer can load (same learning rates, fresh moments), so the
    checkpoint also resumes without this callback.
    """

    swaps_optimizer = True

    @property
    def steps_in_backward(self) -> bool:  # read by the compatibility rules
        return self.optimizer_in_backward

    @property
    def sharding_conflict(self) -> str | None:  # read by the compatibility rules
        module = optimizer_class(self.optimizer_name).__module__
        if module.startswith("torch."):
            return None  # torch's optimizers step DTensor shards
        return (
            f"the optimizer {self.optimizer_name!r} ({module}) steps plain tensors and cannot "
            "step sharded (DTensor) parameters. Use OptimizerSwap('adamw_fused') (torch's AdamW) "
            "under FSDP, or ZeROOffload / DDP to keep a non-torch optimizer"
        )

    def __init__(
        self,
        name: str,
        overrides: dict[str, Any] | None = None,
        optimizer_in_backward: bool = False,
        embeddings_32bit: bool = True,
        on_mismatch: str = "error",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.overrides = merge_overrides(name, overrides, kwargs)
        self.optimizer_name = name
        self.optimizer_in_backward = check_bool("optimizer_in_backward", optimizer_in_backward)
        self.embeddings_32bit = check_bool("embeddings_32bit", embeddings_32bit)
        self.on_mismatch = check_choice("on_mismatch", on_mismatch, ("error", "reset"))
        self._originals: list[Optimizer] = []
        self._swapped: list[Optimizer] = []
        self._loaded_checkpoint: dict[str, Any] | None = None
        self._restored: dict[str, Any] | None = None

    def configure_estimate(self, plan: Any) -> None:
        """Swap the estimate's optimizer and switch optimizer-in-backward like the fit would: on
        fake tensors, bitsandbytes and Adafactor run as their estimate-only state models."""
        name = self.optimizer_name
        keep = kept_32bit_parameters(plan.model, name, self.embeddings_32bit)
        plan.optimizer = estimate_optimizer(name, keep, self.overrides)
        plan.optimizer_in_backward = self.optimizer_in_backward
        plan.note(
            f"{self.name}: optimizer {name!r}"
            + (", stepped in backward" if self.optimizer_in_backward else "")
        )

    # -- when -----------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        old = list(trainer.optimizers)
        if not old:
            self.no_effect("the module configured no optimizer; nothing to swap.")
            return
        params = [p for opt in old for g in opt.param_groups for p in g["params"]]
        mixed = check_low_precision_weights(self.optimizer_name, params)  # refuses 32-bit ones
        keep = kept_32bit_parameters(pl_module, self.optimizer_name, self.embeddings_32bit)
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        new, dropped = [], set()
        for opt in old:
            change = apply_optimizer_swap(
                opt,
                self.optimizer_name,
                schedulers=schedulers,
                keep_32bit=keep,
                model=pl_module,
                in_backward=self.optimizer_in_backward,
                **self.overrides,
            )
            if self.optimizer_in_backward:  # its gradient hooks off the parameters after fit
                self.record(trainer, change)
            # otherwise no object of the user's changed: the optimizers and LR schedulers are the
            # trainer's, built anew by `configure_optimizers` at every fit, and after the fit
            # they stay as trained (the swapped optimizer, its schedulers pointed at it)
            new.append(change.value)
            dropped |= set(change.figures["dropped"])
        trainer.optimizers = new
        self._originals, self._swapped = old, new
        no_effect, notes = swap_messages(self.optimizer_name, new, self.overrides, dropped)
        if no_effect is not None:
            self.no_effect(no_effect)
        self._prepare_restore()
        for message in notes + ([mixed] if mixed else []):
            self.note(message)
        self.report(trainer, self._change(), optimizers=len(new))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        set_device_flags(self.optimizer_name, self._swapped)  # a restored group lost them

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._swapped:
            self.report(
                trainer,
                self._change(),
                optimizers=len(self._swapped),
                optimizer_state_bytes=sum(optimizer_state_bytes(o) for o in self._swapped),
            )
        super().on_fit_end(trainer, pl_module)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._loaded_checkpoint = None  # a new fit: a checkpoint, if any, is loaded after setup

    def _change(self) -> str:
        olds = ", ".join(sorted({type(o).__name__ for o in self._originals}))
        return f"{olds} -> {self.optimizer_name}" + (
            " (stepped in backward)" if self.optimizer_in_backward else ""
        )

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if not self._swapped:
            return {}
        return swap_entry(self.optimizer_name, self._swapped, self.optimizer_in_backward)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict) if state_dict else None

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # the same dict Lightning restores the optimizers from after on_fit_start
        self._loaded_checkpoint = checkpoint

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("optimizer_states")
        if states and self._swapped:
            make_portable(states, self._originals, self._swapped)

    def _prepare_restore(self) -> None:
        ckpt, entry = self._loaded_checkpoint, self._restored
        self._loaded_checkpoint = self._restored = None
        if ckpt is None or not ckpt.get("optimizer_states"):
            return
        states, warning = reconcile_optimizer_states(
            ckpt["optimizer_states"],
            entry,
            self._originals,
            self._swapped,
            name=self.optimizer_name,
            in_backward=self.optimizer_in_backward,
            on_mismatch=self.on_mismatch,
        )
        if states is not None:
            ckpt["optimizer_states"] = states
        if warning is not None:
            self.warn(warning)
