"""deep_auc's players as torch modules (common/problems/deep_auc.py): loaded by the processes that build them,
never by a coordinator."""

from __future__ import annotations

import torch


class Cnn(torch.nn.Module):
    """conv3x3(1 -> c) ReLU maxpool2, conv3x3(c -> 2c) ReLU maxpool2, linear(2c (side/4)^2 -> hidden) ReLU,
    linear(-> 1): the score's logit for a side x side image (deep_auc's: 8 x 8)."""

    def __init__(self, channels: int, hidden: int, side: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc1 = torch.nn.Linear(2 * channels * (side // 4) ** 2, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(images)), 2)
        h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
        h = torch.relu(self.fc1(h.flatten(1)))
        logits: torch.Tensor = self.fc2(h).squeeze(1)
        return logits


class AucModel(torch.nn.Module):
    """The min player: the network and AUC-M's a and b. On the wire (named_parameters order, which lists a
    module's own parameters before its submodules'): a, b, then the network's."""

    def __init__(self, channels: int, hidden: int, side: int) -> None:
        super().__init__()
        self.net = Cnn(channels, hidden, side)
        self.a = torch.nn.Parameter(torch.zeros(1))
        self.b = torch.nn.Parameter(torch.zeros(1))
