"""Small models of the families "auto" must handle, written here (no torchvision: its wheels in
the registry are CUDA builds) or built from transformers configs. Used by
tests/techniques/activation_checkpointing/test_gallery.py and benchmarks/gallery_blocks.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


# -- ResNet-like: BasicBlocks with BatchNorm, stages of decreasing resolution ---------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNetLike(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(
            BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width)
        )
        self.layer3 = nn.Sequential(  # resnet34-like: the deepest stage has the most blocks
            BasicBlock(2 * width, 4 * width, 2),
            BasicBlock(4 * width, 4 * width),
            BasicBlock(4 * width, 4 * width),
        )
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean((2, 3)))


# -- ConvNeXt-like: depthwise conv, LayerNorm, inverted MLP, layer scale --------------------------
class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.gamma * self.pwconv2(F.gelu(self.pwconv1(y)))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (8, 16, 32), depth: int = 2) -> None:
        super().__init__()
        self.downsample_layers = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(3, dims[0], 2, 2), LayerNorm2d(dims[0]))]
            + [
                nn.Sequential(LayerNorm2d(a), nn.Conv2d(a, b, 2, 2))
                for a, b in zip(dims[:-1], dims[1:])
            ]
        )
        self.stages = nn.ModuleList(
            nn.Sequential(*[ConvNeXtBlock(d) for _ in range(depth)]) for d in dims
        )
        self.head = nn.Linear(dims[-1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for down, stage in zip(self.downsample_layers, self.stages):
            x = stage(down(x))
        return self.head(x.mean((2, 3)))


# -- U-Net-like: ModuleDicts of conv blocks with skips ---------------------------------------------
class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UNetLike(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        w = width
        self.down = nn.ModuleDict(
            {"d0": DoubleConv(3, w), "d1": DoubleConv(w, 2 * w), "d2": DoubleConv(2 * w, 4 * w)}
        )
        self.bottleneck = DoubleConv(4 * w, 8 * w)
        self.up = nn.ModuleDict(
            {
                "u2": nn.ConvTranspose2d(8 * w, 4 * w, 2, 2),
                "u1": nn.ConvTranspose2d(4 * w, 2 * w, 2, 2),
                "u0": nn.ConvTranspose2d(2 * w, w, 2, 2),
            }
        )
        self.dec = nn.ModuleDict(
            {
                "c2": DoubleConv(8 * w, 4 * w),
                "c1": DoubleConv(4 * w, 2 * w),
                "c0": DoubleConv(2 * w, w),
            }
        )
        self.out = nn.Conv2d(w, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down.values():
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for (_, up), (_, dec), skip in zip(self.up.items(), self.dec.items(), reversed(skips)):
            x = dec(torch.cat([up(x), skip], 1))
        return self.out(x)


# -- DenseNet-like: each layer takes the growing list of earlier feature maps ------------------------
class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, 2 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(2 * growth)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.conv1(F.relu(self.norm1(torch.cat(features, 1))))
        return self.conv2(F.relu(self.norm2(x)))


class DenseNetLike(nn.Module):
    def __init__(self, ch: int = 8, growth: int = 8, n: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1, bias=False)
        self.layers = nn.ModuleList(DenseLayer(ch + i * growth, growth) for i in range(n))
        self.norm = nn.BatchNorm2d(ch + n * growth)
        self.head = nn.Linear(ch + n * growth, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))  # the list the layer saw grows after the call
        return self.head(F.relu(self.norm(torch.cat(features, 1))).mean((2, 3)))


# -- the gallery: name -> (build, batch, loss_fn, best single block class) --------------------------
def _image_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _pixel_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch).square().mean()


def _hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch).loss


def _images(n: int = 4, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def _ids(n: int, seq: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))


def _vit() -> nn.Module:
    import transformers

    cfg = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=4,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTForImageClassification(cfg)


def _t5() -> nn.Module:
    import transformers

    cfg = transformers.T5Config(
        d_model=32,
        d_ff=64,
        d_kv=8,
        num_heads=4,
        num_layers=2,
        vocab_size=64,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _llama() -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg)


def _bert() -> nn.Module:
    import transformers

    cfg = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(cfg)


def _text(seq: int = 64) -> dict[str, torch.Tensor]:
    ids = _ids(4, seq)
    return {"input_ids": ids, "labels": ids}


GALLERY: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], Any, str]] = {
    "resnet": (ResNetLike, _images, _image_loss, "BasicBlock"),
    "convnext": (ConvNeXtLike, _images, _image_loss, "ConvNeXtBlock"),
    "unet": (UNetLike, lambda: torch.randn(2, 3, 32, 32), _pixel_loss, "DoubleConv"),
    "densenet": (DenseNetLike, _images, _image_loss, "DenseLayer"),
    "vit": (
        _vit,
        lambda: {"pixel_values": _images()[0], "labels": _images()[1]},
        _hf_loss,
        "ViTLayer",
    ),
    "t5": (
        _t5,
        lambda: {"input_ids": _ids(4, 64), "labels": _ids(4, 32)},
        _hf_loss,
        "T5Block",
    ),
    "llama": (_llama, _text, _hf_loss, "LlamaDecoderLayer"),
    "bert": (_bert, _text, _hf_loss, "BertLayer"),
}
