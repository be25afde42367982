"""Fully sharded data parallel (torch's FSDP2) for an unmodified LightningModule.

Lightning's ``FSDPStrategy`` uses torch's FSDP1, which needs an accelerator device, and its
``ModelParallelStrategy`` (FSDP2) asks the module to call ``fully_shard`` in its own
``configure_model``. ``FullyShardedStrategy`` is a ``ModelParallelStrategy`` that does that
itself: ``apply_fully_shard`` shards each repeated block (the blocks activation checkpointing
finds, ``techniques._blocks.select_modules``), then the root module, over a one-dimensional
device mesh of every rank (CPU with gloo, or CUDA with NCCL). Parameters become DTensors; each
rank keeps ``1 / world_size`` of every parameter, gradient and optimizer state and gathers one
block's full parameters at a time in forward and backward.

Checkpoints are saved whole (``save_distributed_checkpoint=False``): one file with the full state
dict and the full optimizer state keyed as a plain run keys it, so a plain (one-process) run
resumes from it, and this strategy resumes from a plain run's checkpoint.

Techniques that change the module (activation checkpointing, compile) apply in their callback's
``on_fit_start``, after this strategy sharded it in ``strategy.setup``: a checkpointed block's
forward is shadowed in place, and FSDP's gather hooks run around it (a class-name policy matches
the ``FSDP<Name>`` class ``fully_shard`` swaps in). The memory estimate refuses a sharded module
(its first forward would set up FSDP's state on fake tensors); the techniques that cannot handle
sharded (DTensor) parameters declare ``Technique.sharding_conflict`` and the fit stops before the
first step (``core.compat``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_efficient.core import _internals
from lightning_efficient.core.environ import LauncherEnviron
from lightning_efficient.core.report import report_for
from lightning_efficient.core.technique import techniques_of
from lightning_efficient.core.validate import check_bool, check_choice
from lightning_efficient.techniques._blocks import check_policy, select_modules

__all__ = [
    "FullyShardedStrategy",
    "apply_fully_shard",
    "sharded_modules",
    "optimizer_param_names",
    "optimizer_state_to_plain",
    "optimizer_state_from_plain",
    "DTYPES",
]

#: Names accepted for the mixed-precision policy's dtypes.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
#: The LightningModule methods that run the forward (FSDP's hooks must run around them).
FORWARD_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def apply_fully_shard(
    model: nn.Module,
    mesh: Any,
    policy: Any = "auto",
    *,
    reshard_after_forward: bool = True,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    cpu_offload: bool = False,
    forward_methods: tuple[str, ...] = FORWARD_METHODS,
) -> list[str]:
    """Shard ``model`` in place with FSDP2: each block of ``policy`` (see
    ``techniques._blocks.select_modules``), then the root. Returns the sharded blocks' names.

    ``reshard_after_forward=False`` keeps each block's gathered parameters from forward to
    backward (FSDP1's SHARD_GRAD_OP, ZeRO-2-like: less communication, more memory).
    ``param_dtype``/``reduce_dtype`` ("bf16", "fp16", "fp32") set the mixed-precision policy;
    ``cpu_offload`` keeps the shards (and their gradients and optimizer state) in host memory.
    Methods in ``forward_methods`` that the root has run FSDP's hooks as ``forward`` does, so a
    LightningModule whose ``training_step`` calls an inner module is gathered correctly.
    State-dict keys are unchanged (``fully_shard`` swaps the class, never the names).
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if param_dtype or reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES[param_dtype] if param_dtype else None,
            reduce_dtype=DTYPES[reduce_dtype] if reduce_dtype else None,
        )
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    try:
        blocks = select_modules(model, policy, argument="policy")
    except ValueError:
        if policy != "auto":
            raise
        blocks = []  # no repeated blocks: the root alone holds every parameter
    for _, block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})  # root: gathered in backward
    for name in forward_methods:
        if callable(getattr(model, name, None)):
            register_fsdp_forward_method(model, name)
    return [name for name, _ in blocks]


def optimizer_param_names(model: nn.Module, optimizer: Any) -> list[str]:
    """The names of ``optimizer``'s parameters in its own order (group by group): the order a
    plain ``Optimizer.state_dict()`` numbers them in."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_to_plain(state: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name (``get_optimizer_state_dict``) -> the
    plain ``Optimizer.state_dict()`` form, keyed by position in ``order``."""
    index = {name: i for i, name in enumerate(order)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {index[n]: v for n, v in state["state"].items()}, "param_groups": groups}


def optimizer_state_from_plain(state: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_to_plain` (a plain run's checkpoint -> names)."""
    if not state.get("param_groups") or not isinstance(state["param_groups"][0]["params"][0], int):
        return state  # already keyed by name
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {order[i]: v for i, v in state["state"].items()}, "param_groups": groups}


def sharded_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that FSDP2 shards ("" is the root)."""
    return _internals.fsdp_sharded(model)


class FullyShardedStrategy(ModelParallelStrategy):
    """Shard an unmodified LightningModule with torch's FSDP2 (``fully_shard``), on CPU or GPU.

    Args:
        policy: which modules to shard one by one before the root: ``"auto"`` (the repeated
            blocks, as activation checkpointing finds them), a class, class name, name glob,
            ``"re:<regex>"`` or a list of these.
        sharding: ``"full"`` (parameters resharded after each block's forward, gathered again
            in backward: FSDP's FULL_SHARD, ZeRO-3) or ``"grad_op"`` (kept gathered from forward
            to backward: SHARD_GRAD_OP, ZeRO-2-like memory for parameters in flight).
        param_dtype: dtype the gathered parameters compute in ("bf16", "fp16", "fp32"; ``None``:
            as stored). The sharded master copy stays in its own dtype.
        reduce_dtype: dtype gradients are reduced in (``None``: ``param_dtype``).
        cpu_offload: keep parameter shards, gradients and optimizer state in host memory.
        process_group_backend: "gloo", "nccl" or ``None`` (chosen from the device).
        timeout: the process group's timeout.

    Checkpoints are written whole (one file a plain run reads); resuming a plain run's
    checkpoint works too.
    """

    #: Read by ``core.compat``: parameters are DTensors, each rank holds a shard.
    shards_parameters: bool = True

    @property
    def estimate_sharding(self) -> str:
        """Read by ``measure.memory.settings``: the per-rank estimate's ``sharding`` for this
        strategy."""
        return self.sharding

    def __init__(
        self,
        policy: Any = "auto",
        sharding: str = "full",
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        cpu_offload: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
    ) -> None:
        self.policy = check_policy(policy, argument="policy")
        self.sharding = check_choice("sharding", sharding, ("full", "grad_op"))
        for arg, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None:
                check_choice(arg, value, tuple(DTYPES))
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.cpu_offload = check_bool("cpu_offload", cpu_offload)
        if process_group_backend is not None:
            check_choice("process_group_backend", process_group_backend, ("gloo", "nccl"))
        super().__init__(
            save_distributed_checkpoint=False,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.sharded_blocks: list[str] = []
        self._launch_environ = (
            LauncherEnviron()
        )  # as before the launch (which runs before any hook)

    def setup_environment(self) -> None:
        # one data-parallel dimension over every rank (the parent's default is nodes x devices)
        world = max(1, self.num_nodes * self.num_processes)
        _internals.set_model_parallel_sizes(self, data_parallel=world, tensor_parallel=1)
        if world == 1:  # one process: the launch's variables go back at teardown
            self._launch_environ.record(self.lightning_module.trainer)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        # the parent's setup, with the sharding done here instead of in the module's configure_model
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        self.sharded_blocks = apply_fully_shard(
            self.model,
            self.device_mesh["data_parallel"],
            self.policy,
            reshard_after_forward=self.sharding == "full",
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            cpu_offload=self.cpu_offload,
        )
        self.model = self.precision_plugin.convert_module(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._report(trainer)

    def model_to_device(self) -> None:
        assert self.model is not None
        if not self.cpu_offload:  # with offload the shards live in host memory
            self.model.to(self.root_device)

    def _report(self, trainer: Any) -> None:
        world = self.world_size
        blocks = len(self.sharded_blocks)
        mode = "FULL_SHARD" if self.sharding == "full" else "SHARD_GRAD_OP"
        extras = [f"{self.param_dtype} compute"] if self.param_dtype else []
        extras += ["shards on CPU"] if self.cpu_offload else []
        report_for(trainer).add(
            type(self).__name__,
            f"{mode} over {world} ranks: {blocks} blocks + root, each rank holds 1/{world} of "
            "parameters, gradients and optimizer state"
            + (f" ({', '.join(extras)})" if extras else ""),
            world_size=world,
            blocks=blocks,
        )

    # -- checkpoints a plain run reads: full state, optimizer state keyed as a plain run keys it
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's own
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(self.model, optimizer, options=options)
        if not state:  # only rank zero receives the full state
            return state
        return optimizer_state_to_plain(state, optimizer_param_names(self.model, optimizer))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = self.broadcast(checkpoint_path)
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        strict = self.lightning_module.strict_loading
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
                order = optimizer_param_names(self.model, optimizer)
                state = optimizer_state_from_plain(state, order)
                set_optimizer_state_dict(self.model, optimizer, state, options=options)
        return checkpoint

    def teardown(self) -> None:
        # Lightning calls a strategy's teardown after a fit, on an exception and on an interrupt
        # (``core/environ.py``), so the strategy undoes its change here, even if the parent's
        # teardown raises. One process: the launcher variables go back, so a process started
        # later does not think it was launched; the process group itself stays for the next fit
        # here (a group destroyed under DeepSpeed's cached groups breaks a later ZeRO fit). The
        # sharded module stays sharded, as Lightning's own FSDP strategies leave it: unsharding
        # needs every rank to gather every parameter, which an exception on one rank cannot join.
        try:
            super().teardown()
        finally:
            self._launch_environ.undo()

    def on_train_end(self) -> None:
        super().on_train_end()
        trainer = self.lightning_module.trainer
        if not techniques_of(trainer):  # otherwise the last technique shows it at fit end
            report_for(trainer).show(trainer)
