"""measure/memory/cuda_kernels.py: CUDA's kernels modelled on a CPU (attention backend, dropout,
autocast policy, cuBLAS workspaces), checked against torch's own registrations and rules, and
by what the modelled kernels save for backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_efficient.core._internals import FakeTensorMode, ops_with_kernel
from lightning_efficient.measure.memory.cuda_kernels import (
    AUTOCAST_CUDA,
    PRIORITY,
    AttentionCall,
    attention_backend,
    cuda_kernels,
    priority,
)
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.targets import DeviceTarget, resolve_target, workspace_bytes

H200 = resolve_target("cuda:h200")
BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16


def test_the_autocast_table_covers_exactly_what_torch_registers_for_cuda_autocast() -> None:
    registered = {
        n.removeprefix("aten::") for n in ops_with_kernel("AutocastCUDA") if n.startswith("aten::")
    }
    assert registered == set(AUTOCAST_CUDA), (
        f"missing: {sorted(registered - set(AUTOCAST_CUDA))}, "
        f"not registered: {sorted(set(AUTOCAST_CUDA) - registered)}"
    )


def test_other_libraries_autocast_kernels_are_left_as_they_are() -> None:
    """torchvision registers CPU autocast kernels for its own operators (seen on the GPU
    machine's image): the model replaces ATen's only."""
    lib = torch.library.Library("le_test_ops", "DEF")
    try:
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
        lib.impl("twice", lambda x: torch.ops.le_test_ops.twice(x), "AutocastCPU")
        assert "le_test_ops::twice" in ops_with_kernel("AutocastCPU")
        with cuda_kernels(H200):
            assert torch.equal(torch.ops.le_test_ops.twice(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        lib._destroy()


def _call(q=(8, 12, 1024, 64), k=None, v=None, dtype=BF16, **kw) -> AttentionCall:
    return AttentionCall(query=q, key=k or q, value=v or k or q, dtype=dtype, **kw)


A100 = resolve_target("cuda:a100")
H200_2_11 = DeviceTarget("cuda", (9, 0), (2, 11), name="H200")  # cuDNN 9.19, as measured
H200_LATER = DeviceTarget("cuda", (9, 0), (2, 14))
# expected backends read off torch's select_sdp_backend (sdp_utils.cpp) for each case; the
# first one was measured: torch 2.11 with cuDNN 9.19 on an H200 chose cuDNN for GPT-2's shape
GRID = [
    ("bf16, causal, dropout 0.1, H200", _call(causal=True, dropout=0.1), H200_2_11, "cudnn"),
    ("bf16, causal, dropout 0.1, A100", _call(causal=True, dropout=0.1), A100, "flash"),
    ("dropout 0.1 below cuDNN's 1/16 steps", _call(dropout=0.1), H200_LATER, "flash"),
    ("bf16, dropout 1/8, H200", _call(dropout=0.125), H200_LATER, "cudnn"),
    ("fp16 on an A100", _call(dtype=FP16), A100, "flash"),
    (
        "fp32: no fused flash or cuDNN",
        _call(dtype=FP32, causal=True, dropout=0.1),
        H200,
        "efficient",
    ),
    ("bf16 with a float mask, A100", _call(mask="float"), A100, "efficient"),
    ("bf16 with a bool mask, A100", _call(mask="bool"), A100, "efficient"),
    ("bf16 with a float mask, H200", _call(mask="float"), H200, "cudnn"),
    ("bf16 GQA, A100", _call(k=(8, 4, 1024, 64), gqa=True), A100, "flash"),
    ("bf16 GQA, H200", _call(k=(8, 4, 1024, 64), gqa=True), H200, "cudnn"),
    (
        "fp32 GQA, torch 2.11: math",
        _call(k=(8, 4, 1024, 64), dtype=FP32, gqa=True),
        H200_2_11,
        "math",
    ),
    (
        "fp32 GQA, later sources: efficient",
        _call(k=(8, 4, 1024, 64), dtype=FP32, gqa=True),
        H200_LATER,
        "efficient",
    ),  # fmt: skip
    ("heads differ without enable_gqa", _call(k=(8, 4, 1024, 64)), H200, "math"),
    ("head dim 512: too large for flash and cuDNN", _call(q=(2, 4, 128, 512)), H200, "efficient"),
    # measured: torch 2.11 with cuDNN 9.19 on an H200 took head dim 200 (training, dropout)
    (
        "head dim 200, H200, torch 2.11: cuDNN to 256",
        _call(q=(2, 4, 128, 200), dropout=0.1),
        H200_2_11,
        "cudnn",
    ),  # fmt: skip
    (
        "head dim 200, H200, later sources: flash",
        _call(q=(2, 4, 128, 200), dropout=0.125),
        H200_LATER,
        "flash",
    ),  # fmt: skip
    ("head dim 20: flash pads it", _call(q=(2, 4, 128, 20)), H200, "flash"),
    ("fp32 head dim 6: not aligned", _call(q=(2, 4, 128, 6), dtype=FP32), H200, "math"),
    (
        "causal, query shorter than key",
        _call(q=(2, 4, 16, 64), k=(2, 4, 128, 64), causal=True),
        A100,
        "efficient",
    ),  # fmt: skip
    ("fp16 on a T4 (sm75)", _call(dtype=FP16), resolve_target("cuda:t4"), "efficient"),
    ("bf16 on a T4: no kernel takes it", _call(), resolve_target("cuda:t4"), "math"),
    (
        "sm86 training, head dim 200 with dropout",
        _call(q=(2, 4, 128, 200), dropout=0.1),
        resolve_target("cuda:a10"),
        "efficient",
    ),
    ("3-D inputs", _call(q=(8, 1024, 64)), H200, "math"),
    ("a storage offset not aligned", _call(dtype=FP32, offsets=(0, 2, 0)), H200, "math"),
    (
        "cuDNN 9.12 with dropout",
        _call(dropout=0.1),
        DeviceTarget("cuda", (9, 0), (2, 11), cudnn_version=91200),
        "flash",
    ),  # fmt: skip
]


@pytest.mark.parametrize("case", GRID, ids=[g[0] for g in GRID])
def test_attention_backend_follows_torchs_cuda_rules(case) -> None:
    _, call, target, expected = case
    backend, skipped = attention_backend(call, target)
    assert backend == expected, skipped
    order = priority(target)
    assert list(skipped) == list(order[: order.index(backend)])  # each with its reason
    assert all(skipped.values())


def test_cudnn_first_on_hopper_with_a_recent_cudnn() -> None:
    assert priority(H200_2_11)[0] == "cudnn" and priority(A100) == PRIORITY
    assert priority(DeviceTarget("cuda", (9, 0), (2, 11), cudnn_version=91500)) == PRIORITY
    assert priority(DeviceTarget("cuda", (9, 0), (2, 10))) == PRIORITY
    torch.use_deterministic_algorithms(True)
    try:  # cuDNN's attention is not deterministic
        assert attention_backend(_call(causal=True), H200_2_11)[0] == "flash"
    finally:
        torch.use_deterministic_algorithms(False)


def test_attention_backend_reads_the_runtime_switches() -> None:
    call = _call(causal=True)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
        assert attention_backend(call, A100)[0] == "efficient"
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
        assert attention_backend(call, A100)[0] == "cudnn"
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        with pytest.raises(RuntimeError, match="no available kernel"):
            attention_backend(_call(dtype=FP32), A100)
    assert attention_backend(call, A100)[0] == "flash"  # switches restored


class Attention(nn.Module):
    def __init__(self, heads: int = 4, dim: int = 32, dropout: float = 0.0, gqa: int = 1):
        super().__init__()
        self.heads, self.kv, self.dropout = heads, heads // gqa, dropout
        self.q = nn.Linear(dim, dim)
        self.kv_proj = nn.Linear(dim, 2 * dim // gqa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, s, 2 * self.kv, -1).transpose(1, 2).chunk(2, dim=1)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout,
            enable_gqa=self.kv != self.heads,
        )
        return y.transpose(1, 2).reshape(b, s, d)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).float().pow(2).mean()


def _activations(model: nn.Module, batch: torch.Tensor, device: Any) -> tuple[int, Any]:
    est = estimate_memory(model, batch, loss_fn=_loss, optimizer="sgd", device=device)
    return est.by_category["activations"], est  # saved for backward, at the peak


def test_fused_attention_saves_no_probabilities_where_the_cpus_math_path_does() -> None:
    b, s, h = 2, 256, 4
    x = torch.randn(b, s, 32)
    cpu, _ = _activations(Attention(dropout=0.1), x, "cpu")
    cuda, est = _activations(Attention(dropout=0.1), x, "cuda:h200")
    # the CPU runs math with dropout: probabilities, dropout mask and dropped probabilities
    # (fp32 B x H x S x S each); the efficient kernel (fp32 on CUDA) saves none of them
    probs = b * h * s * s * 4
    assert cpu - cuda >= 2.5 * probs
    assert "efficient x2" in " ".join(est.notes)


def test_math_on_cuda_where_the_cpu_has_a_fused_kernel_fp32_gqa() -> None:
    b, s, h = 2, 256, 4
    x = torch.randn(b, s, 32)
    cpu, _ = _activations(Attention(gqa=2), x, "cpu")  # CPU flash: no dropout, GQA supported
    old = DeviceTarget("cuda", (9, 0), (2, 11))
    cuda, est = _activations(Attention(gqa=2), x, old)
    probs = b * h * s * s * 4
    assert cuda >= probs > 4 * cpu  # math saves the fp32 probabilities; CPU flash does not
    assert "math x2" in " ".join(est.notes)


def _saved_dtypes(fn, *tensors) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*tensors)
    return saved


def test_dropout_saves_a_one_byte_mask_as_cuda_does() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        cpu = _saved_dtypes(lambda t: F.dropout(t, 0.1, True), x)
        with cuda_kernels(H200):
            cuda = _saved_dtypes(lambda t: F.dropout(t, 0.1, True), x)
            eval_mode = F.dropout(x, 0.1, False)
    assert cpu == [(torch.float32, (4, 8))]  # the CPU's noise tensor
    assert cuda == [(torch.bool, (4, 8))]  # native_dropout's mask
    assert eval_mode is x


def test_autocast_follows_cudas_policy_and_is_put_back_after() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8)
    y = torch.zeros(4, dtype=torch.long)

    def run():
        with torch.autocast("cpu", dtype=BF16):
            h = F.linear(x, w)
            return (
                h.dtype,
                torch.pow(h, 3.0).dtype,
                F.layer_norm(h, (8,)).dtype,
                torch.softmax(h, -1).dtype,
                F.cross_entropy(h, y).grad_fn.next_functions[0][0].name(),
            )

    with FakeTensorMode(allow_non_fake_inputs=True):
        cpu_before = run()
        with cuda_kernels(H200):
            cuda = run()
            with torch.autocast("cpu", dtype=BF16), pytest.raises(RuntimeError, match="unsafe"):
                F.binary_cross_entropy(torch.sigmoid(x), torch.rand(4, 8))
        cpu_after = run()
    # CUDA: linear in bf16; pow, layer_norm and softmax in fp32; cross_entropy falls through to
    # a bf16 log_softmax whose output nll_loss casts to fp32
    assert cuda == (BF16, FP32, FP32, FP32, "ToCopyBackward0")
    # CPU autocast: pow, layer_norm and softmax stay bf16; cross_entropy casts its input first
    assert cpu_before == (BF16, BF16, BF16, BF16, "LogSoftmaxBackward0") == cpu_after


def test_cublas_workspaces_are_held_once_per_thread_and_only_for_matrix_products() -> None:
    mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    for model, batch, expected in (
        (mlp, torch.randn(4, 16), 2 * workspace_bytes(H200)),  # forward + autograd's thread
        (conv, torch.randn(2, 3, 8, 8), 0),  # cuDNN, not cuBLAS
    ):
        est = estimate_memory(model, batch, loss_fn=_loss, optimizer="sgd", device=H200)
        assert est.by_category["workspaces"] == expected
        cpu = estimate_memory(model, batch, loss_fn=_loss, optimizer="sgd", device="cpu")
        assert cpu.by_category["workspaces"] == 0
    assert workspace_bytes(H200) == 33 * 2**20
    assert workspace_bytes(resolve_target("cuda:a100")) == (8 * 1024 + 128 + 1024) * 1024


def test_the_estimate_names_its_target_and_leaves_the_dispatcher_as_it_was() -> None:
    model, x = Attention(dropout=0.1), torch.randn(2, 16, 32)
    cpu = estimate_memory(model, x, loss_fn=_loss, optimizer="sgd", device="cpu")
    cuda = estimate_memory(model, x, loss_fn=_loss, optimizer="sgd", device="cuda:a100")
    assert cpu.target == "CPU (its own kernels)"
    assert cuda.target.startswith("CUDA sm80 (a100), torch ")
    assert cuda.target in str(cuda) and cuda.to_dict()["target"] == cuda.target
    again = estimate_memory(model, x, loss_fn=_loss, optimizer="sgd", device="cpu")
    assert again.peak_bytes == cpu.peak_bytes  # the CPU's own kernels are back


@pytest.mark.gpu
def test_attention_backend_matches_torchs_own_choice_on_this_gpu() -> None:
    target = resolve_target("cuda")
    names = {1: "flash", 2: "efficient", 0: "math", 3: "cudnn"}
    differ = []
    for name, call, _, _ in GRID:
        if len(call.query) != 4 or call.offsets != (0, 0, 0):
            continue
        q, k, v = (
            torch.randn(*shape, device="cuda", dtype=call.dtype, requires_grad=True)
            for shape in (call.query, call.key, call.value)
        )
        mask = None
        if call.mask:
            mask = torch.ones(call.query[-2], call.key[-2], device="cuda", dtype=torch.bool)
            mask = mask if call.mask == "bool" else mask.to(call.dtype)
        choice = names[
            int(
                torch._fused_sdp_choice(
                    q, k, v, mask, call.dropout, call.causal, enable_gqa=call.gqa
                )
            )
        ]
        facts = AttentionCall.of(q, k, v, mask, call.dropout, call.causal, call.gqa)
        ours = attention_backend(facts, target)[0]
        if ours != choice:
            differ.append(f"{name}: ours {ours}, torch {choice}")
    assert not differ, f"{target.label}: " + "; ".join(differ)
