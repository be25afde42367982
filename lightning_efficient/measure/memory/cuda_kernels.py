"""CUDA's kernels, modelled on a CPU: what an estimate for a CUDA target runs instead of the CPU's.

A CPU build of torch cannot dispatch to CUDA kernels (a fake CUDA tensor aborts the process in
autograd), and where the CPU's kernels save other tensors than CUDA's the CPU-side estimate is
wrong by 2x or more. While :func:`cuda_kernels` is active, three things run as they do on CUDA,
replaced for the duration through the dispatcher (``torch.library``) and restored on exit:

- **Attention** (``scaled_dot_product_attention``): the backend torch's CUDA rules select for
  the shapes, dtype, mask, dropout, GQA and GPU generation (:func:`attention_backend`, a pure
  function), then that backend's own operator (``_scaled_dot_product_flash_attention``,
  ``_efficient_attention``, ``_cudnn_attention`` or the math path), whose autograd formula saves
  what CUDA saves (the output and one log-sum-exp per row for the fused kernels, the
  B x H x L x S probabilities for math). The CPU's own rules differ both ways: it runs the math
  path whenever there is dropout, and its flash kernel where CUDA has none (fp32 with GQA).
- **Dropout**: CUDA's fused ``native_dropout`` (a 1-byte mask saved) where the CPU multiplies by
  a noise tensor of the input's dtype.
- **Autocast**: CUDA's cast policy per operator (:data:`AUTOCAST_CUDA`: e.g. ``pow``,
  ``layer_norm`` and ``softmax`` in fp32, ``cross_entropy`` left to its parts) on the
  ``AutocastCPU`` key, which the fake CPU tensors use. CPU autocast's own list differs.

Plus the **cuBLAS workspaces**: the caching allocator holds one per thread that runs matrix products
(:func:`~lightning_efficient.measure.memory.targets.workspace_allocations`); :func:`workspace_hook`
adds them to the tracker at the first product of the forward and of the backward.

The tables follow torch's sources (``aten/src/ATen/autocast_mode.cpp``,
``native/transformers/cuda/sdp_utils.cpp``, ``attention.cpp``);
``tests/measure/memory/test_cuda_kernels.py`` checks the autocast table against the operators the
installed torch registers for CUDA autocast.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_efficient.core._internals import kernel_overrides, ops_with_kernel
from lightning_efficient.core._internals import without_cpu_autocast as _no_autocast
from lightning_efficient.measure.memory.targets import DeviceTarget, workspace_allocations

__all__ = [
    "AUTOCAST_CUDA",
    "PRIORITY",
    "AttentionCall",
    "attention_backend",
    "priority",
    "cuda_kernels",
    "workspace_hook",
]

# -- autocast: CUDA's policy per operator -----------------------------------------------------------
_LOWER = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)  # fmt: skip
_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm", "rms_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
    "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)  # fmt: skip
_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)  # fmt: skip
#: fp32_append_dtype: the overload without a dtype -> the one its wrapper redispatches to.
_FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "scatter_add", "tensordot",
)  # fmt: skip

#: CUDA autocast's cast policy of every operator it registers (``"lower"``: to the autocast
#: dtype; ``"fp32"``; ``"fp32_set_opt_dtype"``: fp32 output unless a dtype is given;
#: ``"fp32_append_dtype"``; ``"promote"``: the widest input type; ``"banned"``: raises).
AUTOCAST_CUDA: dict[str, str] = {
    **dict.fromkeys(_LOWER, "lower"),
    **dict.fromkeys(_FP32, "fp32"),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
    **dict.fromkeys(_FP32_APPEND_DTYPE, "fp32_append_dtype"),
    **dict.fromkeys(_PROMOTE, "promote"),
    "binary_cross_entropy": "banned",
}

_BCE_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


def _op(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if _eligible(x) and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _widest(args: Any, lower: torch.dtype) -> torch.dtype:
    """Autocast's ``promote``: fp32 when any eligible input is fp32, else the autocast dtype."""
    for x in args:
        items = x if isinstance(x, (list, tuple)) else (x,)
        if any(_eligible(v) and v.dtype == torch.float32 for v in items):
            return torch.float32
    return lower


def _autocast_kernel(name: str, policy: str) -> Callable[..., Any]:
    """A kernel for the ``AutocastCPU`` key that applies CUDA's ``policy`` to ``name``."""
    op = _op(name)
    if policy == "banned":

        def banned(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(_BCE_BANNED)

        return banned
    if policy == "fp32_append_dtype":
        target = _op(_FP32_APPEND_DTYPE[name])

        def append(*args: Any, **kwargs: Any) -> Any:
            with _no_autocast():
                dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
                return target(*args, **kwargs, dtype=dtype)

        return append
    dtype_index = next(
        (i for i, a in enumerate(op._schema.arguments) if a.name == "dtype" and not a.kwarg_only),
        None,
    )

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _no_autocast():
            lower = torch.get_autocast_dtype("cpu")
            if policy == "lower":
                args, kwargs = _cast(args, lower), {k: _cast(v, lower) for k, v in kwargs.items()}
            elif policy == "fp32":
                args = _cast(args, torch.float32)
                kwargs = {k: _cast(v, torch.float32) for k, v in kwargs.items()}
            elif policy == "promote":
                to = _widest((*args, *kwargs.values()), lower)
                args, kwargs = _cast(args, to), {k: _cast(v, to) for k, v in kwargs.items()}
            elif policy == "fp32_set_opt_dtype" and _eligible(args[0]):
                if dtype_index is not None and len(args) > dtype_index:
                    if args[dtype_index] is None:
                        args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


# -- attention: torch's CUDA backend selection --------------------------------------------------
@dataclass(frozen=True)
class AttentionCall:
    """The facts of one ``scaled_dot_product_attention`` call that CUDA's backend choice reads.

    Shapes are ``(batch, heads, length, head dim)``; ``mask`` is ``None``, ``"bool"`` or
    ``"float"``; ``offsets`` are the storage offsets of query, key and value (in elements).
    """

    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: torch.dtype
    mask: str | None = None
    dropout: float = 0.0
    causal: bool = False
    gqa: bool = False
    requires_grad: bool = True
    last_strides: tuple[int, int, int] = (1, 1, 1)
    offsets: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def of(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        enable_gqa: bool = False,
    ) -> AttentionCall:
        tensors = (query, key, value)
        return cls(
            query=tuple(query.shape),
            key=tuple(key.shape),
            value=tuple(value.shape),
            dtype=query.dtype,
            mask=None
            if attn_mask is None
            else ("bool" if attn_mask.dtype == torch.bool else "float"),
            dropout=float(dropout_p),
            causal=bool(is_causal),
            gqa=bool(enable_gqa),
            requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in tensors),
            last_strides=tuple(int(t.stride(-1)) for t in tensors),
            offsets=tuple(int(t.storage_offset()) for t in tensors),
        )


def _heads_ok(call: AttentionCall, supports_gqa: bool) -> str | None:
    bq, hq = call.query[0], call.query[1]
    bk, hk, bv, hv = call.key[0], call.key[1], call.value[0], call.value[1]
    if not bq == bk == bv:
        return "batch sizes differ"
    if hq == hk == hv:
        return None
    if call.gqa and supports_gqa:
        return None if hk == hv and hq % hk == 0 else "query heads not a multiple of key heads"
    return "query, key and value head counts differ" + ("" if call.gqa else " (enable_gqa=False)")


def _flash_problem(call: AttentionCall, target: DeviceTarget) -> str | None:
    cap = target.capability
    if not torch.backends.cuda.flash_sdp_enabled():
        return "disabled (torch.backends.cuda.enable_flash_sdp)"
    if len(call.query) != 4:
        return "inputs are not 4-D"
    if call.mask is not None:
        return "an attention mask is given"
    dq, dk, dv = call.query[-1], call.key[-1], call.value[-1]
    if not dq == dk == dv or dq > 256:
        return "head dims differ or exceed 256"
    if not (8, 0) <= cap <= (12, 1):
        return f"sm{cap[0]}{cap[1]} is outside sm80-sm121"
    if call.requires_grad and ((8, 6) <= cap <= (8, 9) or (12, 0) <= cap <= (12, 1)):
        if not (dq <= 192 or (call.dropout == 0 and dq > 224)):
            return "training with this head dim is not supported on this GPU"
    if call.causal and call.query[-2] != call.key[-2]:
        return "is_causal with query length != key length"
    if call.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {call.dtype} (fp16/bf16 only)"
    heads = _heads_ok(call, supports_gqa=True)
    if heads:
        return heads
    if min(call.query[-2], call.key[-2]) == 0:
        return "a zero sequence length"
    dims = (call.query[-1], call.key[-1], call.value[-1])
    if any(s != 1 and d != 1 for s, d in zip(call.last_strides, dims)):
        return "last dim not contiguous"
    return None


def _efficient_problem(call: AttentionCall, target: DeviceTarget) -> str | None:
    cap = target.capability
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return "disabled (torch.backends.cuda.enable_mem_efficient_sdp)"
    if not (5, 0) <= cap <= (12, 1):
        return f"sm{cap[0]}{cap[1]} is outside sm50-sm121"
    if len(call.query) != 4:
        return "inputs are not 4-D"
    half = call.dtype in (torch.float16, torch.bfloat16)
    tensor_cores = cap[0] >= 8 or (cap[0] >= 7 and half)
    align = 4 if cap[0] >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    dq, dk, dv = call.query[-1], call.key[-1], call.value[-1]
    if dq != dk or dq % align or dv % align or dq <= 0 or dv <= 0:
        return f"head dims not equal or not multiples of {align}"
    if cap[0] >= 8 and any(offset % align for offset in call.offsets):
        return f"storage offsets not aligned to {align} elements"
    if min(call.query[-2], call.key[-2]) == 0:
        return "a zero sequence length"
    if any(s != 1 for s in call.last_strides):
        return "last dim not contiguous"
    # GQA without repeating key/value: not in the kernel up to torch 2.13 ("works only for
    # flash attention and math", the 2.13 docstring); later sources accept it
    heads = _heads_ok(call, supports_gqa=target.torch_version > (2, 13))
    if heads:
        return heads
    allowed = (
        (torch.float16, torch.float32, torch.bfloat16)
        if cap[0] >= 8
        else (
            torch.float16,
            torch.float32,
        )
    )
    if call.dtype not in allowed:
        return f"dtype {call.dtype}"
    return None


#: The order torch tries the backends in where it does not prefer cuDNN (:func:`priority`).
PRIORITY = ("flash", "efficient", "math", "cudnn")


def _cudnn_problem(call: AttentionCall, target: DeviceTarget) -> str | None:
    cap, cudnn = target.capability, target.cudnn_version
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "disabled (torch.backends.cuda.enable_cudnn_sdp)"
    if cudnn < 90000:
        return f"cuDNN {cudnn} is older than 9.0"
    if call.dropout > 0 and 91100 < cudnn < 91400:
        return "cuDNN 9.11-9.13 has no dropout in attention"
    if len(call.query) != 4:
        return "inputs are not 4-D"
    if torch.are_deterministic_algorithms_enabled() and not (
        torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        return "deterministic algorithms are asked for"
    if call.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {call.dtype} (fp16/bf16 only)"
    if not (8, 0) <= cap <= (12, 1):
        return f"sm{cap[0]}{cap[1]} is outside sm80-sm121"
    # the 1/16 resolution of cuDNN's dropout: in later sources; torch 2.11 took dropout 0.1
    if target.torch_version > (2, 13) and call.dropout * 16 != math.floor(call.dropout * 16):
        return "dropout not a multiple of 1/16"
    heads = _heads_ok(call, supports_gqa=True)
    if heads:
        return heads
    dq, dv = call.query[-1], call.value[-1]
    limit = _cudnn_head_dim_limit(target, dq, dv)
    if dq > limit or dv > limit or dq % 8 or dv % 8:
        return f"head dims above {limit} or not multiples of 8"
    if call.key[-2] == 1:
        return "key length 1"
    return None


def _cudnn_head_dim_limit(target: DeviceTarget, dq: int, dv: int) -> int:
    """cuDNN's largest head dim: 256 on sm90/sm100 from cuDNN 9.5.1 up to torch 2.13 (an H200
    with torch 2.11 and cuDNN 9.19 took 200 in training); later sources ask cuDNN > 9.22 for
    256 and allow 192 x 128 from 9.11, else 128."""
    cap, cudnn = target.capability, target.cudnn_version
    hopper_or_blackwell = cap == (9, 0) or cap[0] == 10
    if target.torch_version <= (2, 13):
        return 256 if hopper_or_blackwell and cudnn >= 90501 else 128
    if hopper_or_blackwell and cudnn > 92200:
        return 256
    if hopper_or_blackwell and cudnn >= 91100 and (dq, dv) == (192, 128):
        return 192
    return 128


def priority(target: DeviceTarget) -> tuple[str, ...]:
    """The order torch tries the backends in (``sDPPriorityOrder``): flash, memory-efficient,
    math, cuDNN (after math: only when the others are switched off); on sm90/sm100 with cuDNN
    newer than 9.15 (torch 2.11 on, measured on an H200 with cuDNN 9.19) cuDNN first."""
    if (
        target.capability[0] in (9, 10)
        and target.cudnn_version > 91500
        and target.torch_version >= (2, 11)
    ):
        return ("cudnn", "flash", "efficient", "math")
    return PRIORITY


_PROBLEMS = {"flash": _flash_problem, "efficient": _efficient_problem, "cudnn": _cudnn_problem}


def attention_backend(
    call: AttentionCall, target: DeviceTarget, order: tuple[str, ...] | None = None
) -> tuple[str, dict[str, str]]:
    """The backend torch selects on CUDA for ``call`` (``"flash"``, ``"efficient"``, ``"math"``
    or ``"cudnn"``), and why each backend tried before it was not taken. Follows
    ``select_sdp_backend`` of torch's ``sdp_utils.cpp`` (dense inputs; the runtime switches of
    ``torch.backends.cuda`` are read); ``order``: :func:`priority` of the target."""
    skipped: dict[str, str] = {}
    for backend in order or priority(target):
        if backend == "math":
            if torch.backends.cuda.math_sdp_enabled():
                return "math", skipped
            skipped["math"] = "disabled (torch.backends.cuda.enable_math_sdp)"
            continue
        problem = _PROBLEMS[backend](call, target)
        if problem is None:
            return backend, skipped
        skipped[backend] = problem
    raise RuntimeError(
        "scaled_dot_product_attention: no available kernel on the target "
        f"({target.label}): " + "; ".join(f"{k}: {v}" for k, v in skipped.items())
    )


# -- the operators that replace the CPU's ---------------------------------------------------------
def _bool_to_additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a boolean mask becomes 0 / -inf in ``dtype``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), -math.inf, torch.zeros((), dtype=dtype))


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` of the memory-efficient path: expanded to 4-D, its last dim padded
    to a multiple of 16 (a copy), or made contiguous when its strides are not aligned."""
    b, h, lq = query.shape[0], query.shape[1], query.shape[2]
    bias = mask.expand(b, h, lq, key.shape[-2])
    last = bias.shape[-1]
    if last % 16:
        pad = 16 - last % 16
        return torch.nn.functional.pad(bias, (0, pad))[..., :last]
    if any(s % 16 for s in bias.stride()[:3]):
        return bias.contiguous()
    return bias


def _pad_head_dim(t: torch.Tensor) -> torch.Tensor:
    extra = -t.shape[-1] % 8
    return torch.nn.functional.pad(t, (0, extra)) if extra else t


def _attention_kernel(target: DeviceTarget, chosen: list[str]) -> Callable[..., Any]:
    aten = torch.ops.aten

    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        call = AttentionCall.of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        backend, _ = attention_backend(call, target)
        chosen.append(backend)
        lse = call.requires_grad
        if backend == "cudnn":
            mask = attn_mask if attn_mask is None else attn_mask.to(query.dtype)
            return aten._scaled_dot_product_cudnn_attention(
                query, key, value, mask, lse, dropout_p, is_causal, False, scale=scale
            )[0]
        mask = _bool_to_additive(attn_mask, query.dtype)
        if backend == "flash":
            size = query.shape[-1]
            scale = scale if scale is not None else 1.0 / math.sqrt(size)
            out = aten._scaled_dot_product_flash_attention(
                _pad_head_dim(query),
                _pad_head_dim(key),
                _pad_head_dim(value),
                dropout_p,
                is_causal,
                False,
                scale=scale,
            )[0]
            return out[..., :size] if out.shape[-1] != size else out
        if backend == "efficient":
            bias = _efficient_bias(mask, query, key) if mask is not None else None
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, lse, dropout_p, is_causal, scale=scale
            )[0]
        return aten._scaled_dot_product_attention_math(
            query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]

    return attention


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``at::dropout`` as on CUDA: the fused ``native_dropout`` (mask of 1 byte per element)
    whenever ``0 < p < 1`` in training."""
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, train)[0]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input * torch.zeros_like(input)


def _aten_ops_with_kernel(key: str) -> set[str]:
    """ATen's operators (``"pow.Tensor_Scalar"``) with a kernel for ``key``; other libraries'
    (torchvision registers autocast kernels for its own ops) are theirs to keep."""
    return {n.removeprefix("aten::") for n in ops_with_kernel(key) if n.startswith("aten::")}


@contextlib.contextmanager
def cuda_kernels(target: DeviceTarget) -> Iterator[list[str]]:
    """While inside, operators on CPU tensors run as on ``target``'s CUDA device (attention,
    dropout, autocast; see the module's docstring). Yields the list of attention backends
    chosen, one per call, in order. Process-wide while active: enter it around one estimate."""
    chosen: list[str] = []
    cpu_autocast = _aten_ops_with_kernel("AutocastCPU")
    with kernel_overrides() as lib:
        for name, policy in AUTOCAST_CUDA.items():
            lib.impl(name, _autocast_kernel(name, policy), "AutocastCPU")
        for name in sorted(cpu_autocast - set(AUTOCAST_CUDA)):  # CUDA autocast leaves these be
            lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        lib.impl(
            "scaled_dot_product_attention",
            _attention_kernel(target, chosen),
            "CompositeImplicitAutograd",
        )
        lib.impl("dropout", _dropout, "CompositeImplicitAutograd")
        yield chosen


#: Operators that run on cuBLAS (whose first use on a thread allocates its workspaces).
CUBLAS_OPS = frozenset(
    getattr(torch.ops.aten, n).default
    for n in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "addr")
)


def workspace_hook(target: DeviceTarget) -> Callable[[Any, Any], None]:
    """A tracker hook ``hook(tracker, func)``: at the first cuBLAS operator of the forward (the
    main thread) and of the backward (autograd's device thread), the workspaces that thread's
    cuBLAS handle allocates, held until the end."""
    sizes = workspace_allocations(target)

    def hook(tracker: Any, func: Any) -> None:
        if func in CUBLAS_OPS:
            thread = "autograd" if tracker.phase == "backward" else "main"
            for i, nbytes in enumerate(sizes):
                tracker.hold(("cublas", thread, i), nbytes, "workspaces")

    return hook
