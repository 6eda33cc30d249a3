"""Models for emulated-training experiments (``lowfp train``, tests, benchmarks).

The image classifiers take the input channels, the number of classes and a width multiplier, works on any image
size (8×8 digits to 32×32 CIFAR), and is written the way people write models — in-place ReLUs,
``out += identity`` residuals, ``torch.cat`` and channel shuffles, nn.MultiheadAttention — so
that emulating them exercises what lowfp.emulate must handle.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ResidualCNN", "ResNet18", "MobileNetCNN", "ShuffleNetCNN", "TransformerClassifier", "GPT",
           "MODELS", "build"]


def _ch(c: int, width: float) -> int:
    return max(4, int(round(c * width / 4)) * 4)


def _stem(cin: int, cout: int, act=nn.ReLU) -> nn.Sequential:
    """3×3 convolution, batch norm, in-place activation: the first layer of the CNNs here."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), act(inplace=True))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.shortcut is None else self.shortcut(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResidualCNN(nn.Module):
    """A ResNet-style CNN: a 3×3 stem and two stages of two basic blocks (the second strided)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: float = 1.0):
        super().__init__()
        c1, c2 = _ch(16, width), _ch(32, width)
        self.stem = _stem(in_channels, c1)
        self.layer1 = nn.Sequential(_BasicBlock(c1, c1, 1), _BasicBlock(c1, c1, 1))
        self.layer2 = nn.Sequential(_BasicBlock(c1, c2, 2), _BasicBlock(c2, c2, 1))
        self.fc = nn.Linear(c2, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet18(nn.Module):
    """ResNet-18 as used on CIFAR (the extra-bits paper's Table 3 model): a 3×3 stem without
    pooling and four stages of two basic blocks, 64·width to 512·width channels (11.2 M
    parameters at width 1, 10 classes)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: float = 1.0):
        super().__init__()
        c = [_ch(n, width) for n in (64, 128, 256, 512)]
        self.stem = _stem(in_channels, c[0])
        stages, cin = [], c[0]
        for i, cout in enumerate(c):
            stages.append(nn.Sequential(_BasicBlock(cin, cout, 1 if i == 0 else 2), _BasicBlock(cout, cout, 1)))
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c[-1], num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _DepthwiseSeparable(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.dw = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
        self.bn1 = nn.BatchNorm2d(cin)
        self.pw = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu6(self.bn1(self.dw(x)))
        return F.relu6(self.bn2(self.pw(x)))


class MobileNetCNN(nn.Module):
    """A MobileNet-style CNN of depthwise-separable convolutions."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: float = 1.0):
        super().__init__()
        c = [_ch(n, width) for n in (16, 32, 64)]
        self.stem = _stem(in_channels, c[0], nn.ReLU6)
        self.blocks = nn.Sequential(_DepthwiseSeparable(c[0], c[1], 1), _DepthwiseSeparable(c[1], c[1], 2),
                                    _DepthwiseSeparable(c[1], c[2], 1))
        self.fc = nn.Linear(c[2], num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(x.mean((2, 3)))


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    n, c, h, w = x.shape
    return x.view(n, groups, c // groups, h, w).transpose(1, 2).contiguous().view(n, c, h, w)


class _ShuffleUnit(nn.Module):
    """ShuffleNet v2 unit (stride 1): split the channels, transform one half, concatenate, shuffle."""

    def __init__(self, channels: int):
        super().__init__()
        half = channels // 2
        self.branch = nn.Sequential(
            nn.Conv2d(half, half, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(inplace=True),
            nn.Conv2d(half, half, 3, 1, 1, groups=half, bias=False), nn.BatchNorm2d(half),
            nn.Conv2d(half, half, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(inplace=True))

    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        return channel_shuffle(torch.cat((a, self.branch(b)), dim=1), 2)


class ShuffleNetCNN(nn.Module):
    """A ShuffleNet-style CNN: channel split, depthwise convolutions, concatenation, shuffles."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: float = 1.0):
        super().__init__()
        c1, c2 = _ch(16, width), _ch(32, width)
        self.stem = _stem(in_channels, c1)
        self.stage1 = nn.Sequential(_ShuffleUnit(c1), _ShuffleUnit(c1))
        self.down = nn.Sequential(nn.Conv2d(c1, c2, 3, 2, 1, bias=False), nn.BatchNorm2d(c2),
                                  nn.ReLU(inplace=True))
        self.stage2 = nn.Sequential(_ShuffleUnit(c2), _ShuffleUnit(c2))
        self.fc = nn.Linear(c2, num_classes)

    def forward(self, x):
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.fc(x.mean((2, 3)))


class _EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TransformerClassifier(nn.Module):
    """A small vision Transformer: patch embedding, learned positions, pre-norm encoder blocks
    with nn.MultiheadAttention, mean pooling."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: float = 1.0,
                 image_size: int = 8, patch: int = 2, depth: int = 2, heads: int = 4):
        super().__init__()
        dim = _ch(32, width) if heads <= 4 else _ch(8 * heads, width)
        if image_size % patch:
            raise ValueError(f"image_size {image_size} is not a multiple of patch {patch}")
        self.embed = nn.Conv2d(in_channels, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, (image_size // patch) ** 2, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.Sequential(*[_EncoderBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        x = self.norm(self.blocks(x))
        return self.head(x.mean(1))


class _CausalBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(n, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A small GPT: token and learned position embeddings, pre-norm blocks of causal
    scaled-dot-product attention and a GELU MLP, a final LayerNorm and a linear head.
    ``forward(tokens)`` takes (batch, time) int64 tokens and returns (batch, time, vocab)
    logits."""

    def __init__(self, vocab_size: int, block_size: int = 64, dim: int = 128, depth: int = 4,
                 heads: int = 4):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, block_size, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.Sequential(*[_CausalBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens):
        t = tokens.shape[1]
        if t > self.block_size:
            raise ValueError(f"tokens has {t} positions, more than block_size {self.block_size}")
        x = self.tok(tokens) + self.pos[:, :t]
        return self.head(self.norm(self.blocks(x)))


MODELS = {"resnet": ResidualCNN, "resnet18": ResNet18, "mobilenet": MobileNetCNN, "shufflenet": ShuffleNetCNN,
          "transformer": TransformerClassifier, "gpt": GPT}  # gpt: character windows (pysource)


def build(name: str, in_channels: int, num_classes: int, width: float = 1.0, image_size: int = 8) -> nn.Module:
    """A model of ``MODELS`` by name."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {tuple(MODELS)}, got {name!r}")
    if not (isinstance(width, (int, float)) and width > 0):
        raise ValueError(f"width must be a positive number, got {width!r}")
    if name == "gpt":  # in_channels 1, num_classes the symbols, image_size the window
        dim = max(4, int(round(128 * width / 4)) * 4)
        return GPT(num_classes, block_size=image_size, dim=dim, depth=2, heads=4)
    if name == "transformer":
        patch = 2 if image_size <= 8 else 4
        return TransformerClassifier(in_channels, num_classes, width, image_size=image_size, patch=patch)
    return MODELS[name](in_channels, num_classes, width)
