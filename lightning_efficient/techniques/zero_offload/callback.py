"""``ZeROOffload``: Lightning's DeepSpeed strategy with the ZeRO-Offload decisions made."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, Strategy
from torch.optim import Optimizer

from lightning_efficient.core._internals import DeepSpeedStrategyHooks
from lightning_efficient.core.environ import LauncherEnviron
from lightning_efficient.core.report import report_for
from lightning_efficient.core.validate import check_choice
from lightning_efficient.techniques.zero_offload.config import (
    ESTIMATE_TRACKS,
    SAVE_FORMATS,
    SHORT_NAMES,
    host_buffers,
    numbered_cpu_devices,
    offloaded_categories,
    report_text,
    scale_buckets,
    zero_offload_config,
)
from lightning_efficient.techniques.zero_offload.convert import (
    convert_with_schedulers,
    import_deepspeed,
)
from lightning_efficient.techniques.zero_offload.extensions import ensure_extensions
from lightning_efficient.techniques.zero_offload.loading import (
    check_checkpoint_directory,
    load_checkpoint_file,
    weights_only_loading,
)
from lightning_efficient.techniques.zero_offload.state import (
    full_state_dict,
    load_plain_weights,
    load_zero_optimizer_state,
    optimizer_template,
    parameter_count,
    zero_optimizer_state,
)

__all__ = ["ZeROOffload"]

_TRUST_HINT = "pass weights_only=False to trainer.fit (or validate/test/predict) with ckpt_path"


class ZeROOffload(DeepSpeedStrategyHooks):
    """DeepSpeed ZeRO stage 2/3 with the optimizer (and parameters) offloaded to host memory.

    ``Trainer(strategy=ZeROOffload())`` trains an unmodified LightningModule: its Adam/AdamW (or
    Adagrad) becomes ``DeepSpeedCPUAdam`` (``DeepSpeedCPUAdagrad``) with the same param groups,
    lr, betas, eps and weight decay, and its LR schedulers keep driving it. In yaml:
    ``strategy: zero_offload`` (stage 2, CPU offload) or ``class_path: ZeROOffload``. With
    ``devices > 1`` the same strategy partitions the state across the processes (ZeRO's data
    parallelism); nothing else changes. Runs on a CPU too (gloo), which is how it is tested.
    DeepSpeed's CPU extensions are built on first use, announced, with a stale build lock
    removed (``lightning-efficient prepare`` builds them ahead of time). Checkpoint files load
    with ``weights_only=True`` unless the caller passes ``weights_only=False``.

    Args:
        stage: ZeRO stage, 2 (optimizer state and gradients partitioned/offloaded) or 3
            (parameters too). Stage 1 is refused.
        offload_optimizer: Where the optimizer state, fp32 master weights and gradient partition
            live: ``"cpu"``, ``"nvme"`` (needs ``nvme_path``) or ``None`` (stay on the device).
        offload_parameters: Stage 3 only: keep the parameters in host memory (on NVMe when
            ``offload_optimizer="nvme"``) and fetch them layer by layer.
        nvme_path: Writable directory on a local NVMe drive, for ``offload_optimizer="nvme"``.
        pin_memory: Page-locked host buffers (faster transfers, more host memory pinned).
        config: Extra DeepSpeed settings merged into the built config; it may not contradict a
            named argument (a conflict raises and names both). ``"optimizer"`` here makes
            DeepSpeed build its config optimizer instead of converting the module's.
        save_format: ``"plain"`` writes one Lightning checkpoint file with the full fp32
            ``state_dict`` and the optimizer state in the original optimizer's layout, loadable
            and resumable without DeepSpeed; ``"zero"`` writes DeepSpeed's sharded checkpoint
            directory (consolidate with :func:`export_fp32` / ``lightning-efficient
            export-zero``); ``"auto"``: plain on one process, zero on several.
    """

    strategy_name = "zero_offload"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: str | None = "cpu",
        offload_parameters: bool = False,
        nvme_path: str | None = None,
        pin_memory: bool = True,
        config: dict[str, Any] | None = None,
        save_format: str = "auto",
    ) -> None:
        built = zero_offload_config(
            stage, offload_optimizer, offload_parameters, nvme_path, pin_memory, config
        )
        check_choice("save_format", save_format, SAVE_FORMATS)
        import_deepspeed()
        super().__init__(config=copy.deepcopy(built), logging_level=logging.WARN)
        self.stage = stage
        self.offload_optimizer = offload_optimizer
        self.offload_parameters = offload_parameters
        self.nvme_path = None if nvme_path is None else os.fspath(nvme_path)
        self.pin_memory = pin_memory
        self.user_config = copy.deepcopy(dict(config)) if config else None
        self.save_format = save_format
        self._template: dict[str, Any] | None = None
        self._loaded_plain = False
        self._converted = ""
        self._launch_environ = LauncherEnviron()  # as before fit's launch writes them

    @property
    def gathers_parameters_per_call(self) -> bool:
        """Read by ``core.compat``: under stage 3 a module's parameters are gathered for its
        call and released after it."""
        return self.stage == 3

    @property
    def estimate_sharding(self) -> str:
        """Read by ``measure.memory.settings``: the per-rank estimate's ``sharding`` (``"zero2"``,
        ``"zero3"``)."""
        return f"zero{self.stage}"

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (description, kwargs) in SHORT_NAMES.items():
            strategy_registry.register(name, cls, description=description, override=True, **kwargs)

    # -- devices: DeepSpeed runs on a CPU too (gloo) ----------------------------------------------
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return DeepSpeedStrategy.parallel_devices.fget(self)

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        DeepSpeedStrategy.parallel_devices.fset(self, numbered_cpu_devices(devices))

    def setup_environment(self) -> None:
        ensure_extensions(["shm_comm"])  # DeepSpeed's process group loads it
        if self.world_size == 1:  # one process: the launch's variables go back at teardown
            self._launch_environ.record(self.lightning_module.trainer)
        if isinstance(self.accelerator, CPUAccelerator):
            DDPStrategy.setup_environment(self)  # skip DeepSpeedStrategy's CUDA-only check
        else:
            super().setup_environment()

    def teardown(self) -> None:
        # called on every path, a fit that raised too (``core/environ.py``): the launcher variables
        # go back even if releasing the engine raises (a later process must not inherit the port)
        try:
            release_engine(self.model)  # before the parent unwraps the module from the engine
            super().teardown()
        finally:
            self._launch_environ.undo()

    def setup(self, trainer: Any) -> None:
        if self.config is not None and self.lightning_module is not None:
            self.config = scale_buckets(self.config, max(1, parameter_count(self.lightning_module)))
        super().setup(trainer)

    # -- optimizer: the module's torch optimizer -> its DeepSpeed CPU counterpart ------------------
    def convert_optimizer(self, optimizer: Optimizer, scheduler_config: Any) -> tuple[Any, Any]:
        self._template = optimizer_template(optimizer)
        new, self._converted = convert_with_schedulers(
            optimizer, scheduler_config, self.offload_optimizer
        )
        return new, scheduler_config

    # -- checkpoints ----------------------------------------------------------------------------
    def _plain_format(self) -> bool:
        return self.save_format == "plain" or (self.save_format == "auto" and self.world_size == 1)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._plain_format() and self.lightning_module is not None:
            return full_state_dict(self.lightning_module)
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._plain_format() and self._template is not None:
            return zero_optimizer_state(optimizer, self._template)
        return super().optimizer_state(optimizer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self._plain_format():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        saved = {"stage": self.stage, "offload_optimizer": self.offload_optimizer}
        checkpoint["zero_offload"] = saved
        Strategy.save_checkpoint(self, checkpoint, self.broadcast(filepath), storage_options)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # weights_only=True unless the caller passes False (None: the safe default)
        trusted = weights_only is False
        if os.path.isdir(checkpoint_path):
            self._loaded_plain = False
            check_checkpoint_directory(checkpoint_path, trusted=trusted, how_to_trust=_TRUST_HINT)
            with weights_only_loading(force=not trusted):  # DeepSpeed's loader passes False
                return super().load_checkpoint(checkpoint_path, weights_only)
        self._loaded_plain = True
        return load_checkpoint_file(
            checkpoint_path,
            trusted=trusted,
            how_to_trust=_TRUST_HINT,
            load=lambda path, safe: Strategy.load_checkpoint(self, path, weights_only=safe),
        )

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self._loaded_plain or super().lightning_restore_optimizer

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._loaded_plain:
            return super().load_model_state_dict(checkpoint, strict)
        restore = self.restore_zero_state if self.zero_stage_3 else None
        load_plain_weights(self.lightning_module, checkpoint, strict, restore)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._loaded_plain or self._template is None:
            return super().load_optimizer_state_dict(checkpoint)
        load_zero_optimizer_state(
            self.optimizers[0], self._template, checkpoint["optimizer_states"][0]
        )

    # -- the efficiency report and the memory estimate ------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        module, on = self.lightning_module, (self.offload_optimizer, self.offload_parameters)
        text = report_text(self.stage, *on, self._converted)
        report_for(module.trainer).add(
            type(self).__name__,
            text,
            world_size=self.world_size,
            parameters=parameter_count(module),
        )

    def on_train_end(self) -> None:
        super().on_train_end()
        trainer = self.lightning_module.trainer
        report_for(trainer).show(trainer)

    def configure_estimate(self, plan: Any) -> None:
        """Count what this strategy keeps in host memory as host bytes in the memory estimate:
        the offloaded categories, plus DeepSpeed's other host buffers (``host_buffers``)."""
        configure_offload_estimate(plan, self.config or {})


def release_engine(engine: Any) -> None:
    """Take what a DeepSpeed engine put on the module it wraps off it again: its forward pre- and
    post-hooks and (``engine.destroy()``) the ZeRO optimizer's gradient hooks on every parameter.
    After a fit, and after one that raised, the module runs as it was given. (Stage 3 partitions
    the parameters themselves, which stays.) Anything but an engine is left alone."""
    if not callable(getattr(engine, "destroy", None)) or not hasattr(engine, "module"):
        return
    for name in ("module_forward_pre_hook", "module_forward_post_hook"):
        handle = getattr(engine, name, None)
        if handle is not None:
            handle.remove()
            setattr(engine, name, None)
    engine.destroy()


def configure_offload_estimate(plan: Any, config: Mapping[str, Any]) -> None:
    """Change an ``EstimatePlan`` for a ZeRO ``config``: the offloaded categories count as host
    memory, the optimizer steps one tensor at a time (its step runs on the host), and each
    parameter's optimizer state gains DeepSpeed's other host buffers (fp32 master copy,
    transfer buffers: :func:`host_buffers`), so that the host figure is what DeepSpeed holds."""
    offload = getattr(plan, "offload", None)
    if offload is None:
        offload = plan.offload = {}
    moved = [c for c, on in offloaded_categories(config).items() if on]
    for category in moved:
        offload[category] = True
    if "optimizer_state" in moved:
        # the step runs on the host (DeepSpeedCPUAdam, element-wise): the device sees none of
        # a foreach step's whole-model temporaries; step one tensor at a time instead, so the
        # temporaries left (counted on the device) are one parameter's worth at most
        make = plan.optimizer
        accumulate = getattr(plan, "accumulate_grad_batches", 1)
        largest = max((p.numel() for p in plan.model.parameters() if p.requires_grad), default=0)
        once = {"gradient buffer": largest}  # one buffer of the largest parameter's size
        plan.optimizer = lambda groups: _with_host_buffers(
            _per_tensor(make(groups)), config, accumulate, once
        )
    if moved and hasattr(plan, "note"):
        plan.note(
            f"ZeROOffload: {', '.join(moved)} counted in host memory with DeepSpeed's other host "
            "buffers (fp32 master weights, transfer buffers), optimizer step per tensor (it runs "
            "on the host); one gradient bucket stays on the device, and with parameter offload "
            "each layer's weights visit the device while it runs."
        )


def _per_tensor(optimizer: Optimizer) -> Optimizer:
    for group in optimizer.param_groups:
        if "foreach" in group:
            group["foreach"] = False
        if group.get("fused"):
            group["fused"] = False
    return optimizer


def _with_host_buffers(
    optimizer: Optimizer, config: Mapping[str, Any], accumulate: int, once: dict[str, int]
) -> Optimizer:
    """After each step, give every parameter's state one byte buffer the size of DeepSpeed's
    host buffers for it that the estimate does not track otherwise (counted as optimizer state,
    which offload puts in host memory). ``once["gradient buffer"]``: the largest parameter's
    size, given (once, then cleared) to the first parameter of that size."""
    step = optimizer.step

    def step_and_add_buffers(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                if not state or "zero_host_buffers" in state:
                    continue
                largest = once["gradient buffer"] if p.numel() == once["gradient buffer"] else 0
                if largest:
                    once["gradient buffer"] = 0
                buffers = host_buffers(
                    config,
                    p.numel(),
                    largest_parameter=largest,
                    param_bytes=p.element_size(),
                    accumulate_grad_batches=accumulate,
                )
                extra = sum(v for k, v in buffers.items() if k not in ESTIMATE_TRACKS)
                state["zero_host_buffers"] = torch.empty(extra, dtype=torch.uint8, device=p.device)
        return out

    optimizer.step = step_and_add_buffers  # type: ignore[method-assign]
    return optimizer


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    ZeROOffload.register_strategies(StrategyRegistry)


_register()
