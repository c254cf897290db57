"""The course's models: three for 3x32x32 images and 10 classes, and a transformer.

- ``mlp``: two hidden layers, no BatchNorm. Fast on a laptop CPU, and its DDP run equals
  the single-process big-batch run to float rounding, which makes it the model of the
  equivalence proofs.
- ``cnn``: a small convolutional net *with* BatchNorm, the model of the SyncBatchNorm lab.
- ``resnet18``: torchvision's ResNet-18 adapted to 32x32 images (3x3 stem, no max-pool),
  the usual CIFAR-10 benchmark model for GPU runs.
- ``gpt``: a small decoder-only transformer on byte tokens (:mod:`ddp_lab.gpt`), the model
  of the transformer labs; its size comes from a :class:`~ddp_lab.gpt.GPTConfig`.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_lab.data import IMAGE_SHAPE, NUM_CLASSES
from ddp_lab.errors import UsageError
from ddp_lab.gpt import GPT, GPTConfig

MODELS = ("mlp", "cnn", "resnet18", "gpt")


class MLP(nn.Module):
    """Flatten, two ReLU hidden layers, linear classifier."""

    def __init__(self, hidden: int = 256, num_classes: int = NUM_CLASSES):
        super().__init__()
        d = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(d, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class SmallCNN(nn.Module):
    """Three conv-BatchNorm-ReLU blocks with pooling, then a linear classifier."""

    def __init__(self, width: int = 32, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.features = nn.Sequential(
            _conv_bn(3, width),
            nn.MaxPool2d(2),  # 16x16
            _conv_bn(width, 2 * width),
            nn.MaxPool2d(2),  # 8x8
            _conv_bn(2 * width, 2 * width),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def resnet18_cifar(num_classes: int = NUM_CLASSES) -> nn.Module:
    """torchvision's ResNet-18 with a 3x3 stride-1 stem and no max-pool, for 32x32 inputs."""
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_model(name: str, gpt: GPTConfig | None = None) -> nn.Module:
    """Build a fresh model by name; the current torch seed decides its initial weights.

    Args:
        name: one of :data:`MODELS`.
        gpt: the transformer's size for ``"gpt"`` (default: :class:`GPTConfig`'s).

    Returns:
        The model, on the CPU, in training mode.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> build_model("mlp")(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    if name == "mlp":
        return MLP()
    if name == "cnn":
        return SmallCNN()
    if name == "resnet18":
        return resnet18_cifar()
    if name == "gpt":
        return GPT(gpt or GPTConfig())
    raise UsageError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def has_batchnorm(model: nn.Module) -> bool:
    """True when the model has a BatchNorm layer (whose statistics depend on the batch)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
