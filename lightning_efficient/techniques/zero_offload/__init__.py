"""ZeRO-Offload: DeepSpeed ZeRO stage 2/3 with the optimizer (and parameters) in host memory.

ZeRO-Offload keeps the fp32 master weights, the gradients' fp32 partition and the optimizer state
on the CPU (or NVMe) and runs the optimizer step there (DeepSpeed's ``DeepSpeedCPUAdam``), so the
GPU holds only the parameters it computes with, one gradient bucket and the activations. At
stage 3 with ``offload_parameters`` the parameters live on the host too and are fetched layer by
layer.

Pure functions (no Lightning needed; ``zero_offload_config`` and ``export_fp32`` are in
:mod:`lightning_efficient.functional`):

- ``config``: :func:`zero_offload_config` (the checked DeepSpeed config, a user ``config``
  merged in; a conflicting value is an error, never a silent override), :func:`scale_buckets`
  (bucket sizes for a model's size), :func:`offloaded_categories` and :func:`host_buffers`
  (what lives in host memory, for the memory estimate).
- ``convert``: :func:`to_deepspeed_optimizer` (a torch Adam/AdamW/Adagrad to its DeepSpeed CPU
  counterpart, keeping every group's settings); :func:`rebind_schedulers` points the LR
  schedulers at it.
- ``state``: :func:`zero_optimizer_state` / :func:`load_zero_optimizer_state` (a ZeRO optimizer's
  state in the layout of the original torch optimizer, and back), :func:`full_state_dict`,
  :func:`export_fp32` (a ZeRO checkpoint directory to a plain ``state_dict`` file).
- ``loading``: checkpoint files read with ``weights_only=True`` and an allow-list.
- ``extensions``: :func:`ensure_extensions` builds DeepSpeed's CPU extensions once, announced,
  with stale build locks removed (``lightning-efficient prepare``).

:class:`ZeROOffload` (``strategy``) is Lightning's ``DeepSpeedStrategy`` with these decisions
made, usable on a CPU (gloo) so that tests run the real DeepSpeed.
"""

from lightning_efficient.techniques.zero_offload.callback import ZeROOffload
from lightning_efficient.techniques.zero_offload.config import (
    SAVE_FORMATS,
    host_buffers,
    offloaded_categories,
    scale_buckets,
    zero_offload_config,
)
from lightning_efficient.techniques.zero_offload.convert import (
    SUPPORTED_OPTIMIZERS,
    rebind_schedulers,
    to_deepspeed_optimizer,
)
from lightning_efficient.techniques.zero_offload.extensions import (
    ExtensionBuildError,
    ensure_extensions,
)
from lightning_efficient.techniques.zero_offload.loading import (
    CheckpointError,
    UnsafeCheckpointError,
)
from lightning_efficient.techniques.zero_offload.state import (
    export_fp32,
    full_state_dict,
    load_zero_optimizer_state,
    zero_optimizer_state,
)

__all__ = [
    "ZeROOffload",
    "zero_offload_config",
    "scale_buckets",
    "to_deepspeed_optimizer",
    "rebind_schedulers",
    "zero_optimizer_state",
    "load_zero_optimizer_state",
    "full_state_dict",
    "export_fp32",
    "offloaded_categories",
    "host_buffers",
    "ensure_extensions",
    "CheckpointError",
    "UnsafeCheckpointError",
    "ExtensionBuildError",
    "SUPPORTED_OPTIMIZERS",
    "SAVE_FORMATS",
]
