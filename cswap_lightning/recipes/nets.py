"""The recipes' networks: the demo's small CNN, and VGG-16 and ResNet-50 as torchvision builds
them (in-place ReLUs), with a width knob.

torchvision cannot be installed beside every torch, so the two networks are written out here.
``width`` is the first convolution's channels: 64 gives torchvision's networks, smaller
values shrink every layer in proportion (CI runs them at width 8).
"""

from __future__ import annotations

from torch import Tensor, nn


def build_cnn(width: int = 32, num_classes: int = 10) -> nn.Sequential:
    """A VGG-style ReLU CNN for 8x8 images; in-place ReLUs after BatchNorm, like torchvision's."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * width, 4 * width, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(4 * width * 16, num_classes),
    )



VGG16_LAYERS = (1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M")  # x width


def vgg16(width: int = 64, num_classes: int = 1000, in_channels: int = 3) -> nn.Sequential:
    """VGG-16 (configuration D, no batch norm); the classifier's hidden size is 64 x width."""
    layers: list[nn.Module] = []
    channels = in_channels
    for spec in VGG16_LAYERS:
        if spec == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(channels, spec * width, 3, padding=1), nn.ReLU(inplace=True)]
            channels = spec * width
    hidden = 64 * width
    net = nn.Sequential(
        *layers,
        nn.AdaptiveAvgPool2d((7, 7)),
        nn.Flatten(),
        nn.Linear(channels * 49, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(),
        nn.Linear(hidden, num_classes),
    )
    for module in net.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0, 0.01)
            nn.init.zeros_(module.bias)
    return net


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: the stride sits on the 3x3 convolution."""

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = planes * self.expansion
        self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


def resnet50(width: int = 64, num_classes: int = 1000, in_channels: int = 3) -> nn.Sequential:
    """ResNet-50: a 7x7 stem, then 3, 4, 6 and 3 bottlenecks of width x 1, 2, 4 and 8 planes."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    channels = width
    for stage, blocks in enumerate((3, 4, 6, 3)):
        planes = width * 2**stage
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(Bottleneck(channels, planes, stride))
            channels = planes * Bottleneck.expansion
    net = nn.Sequential(
        *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)
    )
    for module in net.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return net
