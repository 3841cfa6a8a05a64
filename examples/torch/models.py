"""Models for the PyTorch examples, defined here because torchvision is not installed.

- :class:`DigitsCNN`: a small CNN for the 8x8 handwritten digits of scikit-learn.
- :func:`resnet18`, :func:`resnet50`: torchvision's ResNet architecture (He et al., 2016),
  with torchvision's parameter names (``conv1.weight``, ``layer1.0.bn1.weight``, ...
  ``fc.bias``), so ``resnet50().named_parameters()`` matches
  ``hipress/data/gradients/resnet50.json`` name for name and shape for shape.
- :func:`vgg19`: VGG-19 (Simonyan & Zisserman, 2015) with the naming of
  ``hipress/data/gradients/vgg19.json``: ``features.<i>`` is the i-th convolution (0..15)
  and ``classifier.<i>`` the i-th linear layer (0..2).

``build_model(name)`` returns one by name (``MODELS`` lists them) and ``input_shape(name)``
the shape of one input image.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Type, Union

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers for 1x8x8 images.

    About 38k parameters; reaches ~98% test accuracy on scikit-learn's digits in a few
    seconds on a CPU.

    Args:
        num_classes: number of output logits.
        width: channels of the first convolution (the second has twice as many).
    """

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (batch, num_classes) for images of shape (batch, 1, 8, 8)."""
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


# ------------------------------------------------------------------------------ ResNet
def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 convolutions with a shortcut (ResNet-50/101/152, stride on the 3x3)."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the block's output (same layout as torchvision's Bottleneck)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """ResNet for 3x224x224 images, with torchvision's module and parameter names.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: number of blocks in each of the four stages.
        num_classes: output logits.
    """

    def __init__(self, block: Type[Union[BasicBlock, Bottleneck]], layers: List[int],
                 num_classes: int = 1000) -> None:
        super().__init__()
        self._cin = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._stage(block, 64, layers[0], 1)
        self.layer2 = self._stage(block, 128, layers[1], 2)
        self.layer3 = self._stage(block, 256, layers[2], 2)
        self.layer4 = self._stage(block, 512, layers[3], 2)
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _stage(self, block: Type[Union[BasicBlock, Bottleneck]], width: int, blocks: int,
               stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self._cin != width * block.expansion:
            downsample = nn.Sequential(_conv1x1(self._cin, width * block.expansion, stride),
                                       nn.BatchNorm2d(width * block.expansion))
        mods = [block(self._cin, width, stride, downsample)]
        self._cin = width * block.expansion
        mods += [block(self._cin, width) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (batch, num_classes)."""
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """Return ResNet-18 (11.7M parameters at 1000 classes)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """Return ResNet-50 (25.6M parameters, 161 tensors at 1000 classes)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


# --------------------------------------------------------------------------------- VGG
_VGG19_STAGES = [[64, 64], [128, 128], [256, 256, 256, 256], [512, 512, 512, 512],
                 [512, 512, 512, 512]]


class VGG19(nn.Module):
    """VGG-19: 16 3x3 convolutions in five pooled stages, then three linear layers.

    143.7M parameters, 38 tensors at 1000 classes; each stage ends with a 2x2 max-pool.

    ``features`` holds the convolutions only and ``classifier`` the linear layers only, so
    the parameter names are ``features.0.weight`` .. ``features.15.bias`` and
    ``classifier.0.weight`` .. ``classifier.2.bias`` (the naming of the gradient tables).
    """

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        convs, self._pool_after, cin = [], set(), 3
        for stage in _VGG19_STAGES:
            for cout in stage:
                convs.append(nn.Conv2d(cin, cout, 3, padding=1))
                cin = cout
            self._pool_after.add(len(convs) - 1)
        self.features = nn.ModuleList(convs)
        self.classifier = nn.ModuleList([nn.Linear(512 * 7 * 7, 4096), nn.Linear(4096, 4096),
                                         nn.Linear(4096, num_classes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (batch, num_classes) for 3x224x224 images."""
        for i, conv in enumerate(self.features):
            x = F.relu(conv(x))
            if i in self._pool_after:
                x = F.max_pool2d(x, 2)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 7), 1)
        x = F.dropout(F.relu(self.classifier[0](x)), 0.5, self.training)
        x = F.dropout(F.relu(self.classifier[1](x)), 0.5, self.training)
        return self.classifier[2](x)


def vgg19(num_classes: int = 1000) -> VGG19:
    """Return VGG-19."""
    return VGG19(num_classes)


MODELS: Dict[str, Callable[..., nn.Module]] = {
    "digits_cnn": DigitsCNN,
    "resnet18": resnet18,
    "resnet50": resnet50,
    "vgg19": vgg19,
}


def input_shape(name: str, image_size: int = 224) -> tuple:
    """Return the (channels, height, width) of one input image of model ``name``."""
    return (1, 8, 8) if name == "digits_cnn" else (3, image_size, image_size)


def build_model(name: str, **kwargs: int) -> nn.Module:
    """Return a new model by name.

    Raises:
        ValueError: unknown name; the message lists :data:`MODELS`.
    """
    try:
        return MODELS[name](**kwargs)
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
