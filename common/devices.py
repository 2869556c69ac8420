"""Where a process's PyTorch problems compute: `--device cpu|cuda|cuda:K`.

The device is a choice of the process that hosts clients (`fedsaddle client`,
`simulate`, `local`), not of the run: it never travels to the coordinator, and
numpy problems ignore it. `fedsaddle local` hands its choice to the client
processes it starts through the environment variable FEDSADDLE_DEVICE (which
`fedsaddle client` also reads when `--device` is not given), so that several client
processes may share one GPU.

Nothing here imports torch unless a CUDA device is asked for: the core stays
free of it.
"""

from __future__ import annotations

import os
import re

ENVIRONMENT = "FEDSADDLE_DEVICE"
_FORM = re.compile(r"^(cpu|cuda(:\d+)?)$")


class DeviceError(ValueError):
    """A device that is malformed or that this machine does not have; the message says which."""


def parse(name: str) -> str:
    """`name` if it is cpu, cuda or cuda:K; DeviceError otherwise."""
    if not _FORM.match(name):
        raise DeviceError(f"device {name[:40]!r}: expected cpu, cuda or cuda:K (K a GPU's index)")
    return name


def check_available(name: str) -> str:
    """`name`, after checking that this machine has it (a CUDA device needs torch built with CUDA and the
    GPU of that index); DeviceError naming what is missing."""
    parse(name)
    if name == "cpu":
        return name
    try:
        import torch
    except ImportError:
        raise DeviceError(
            f"device {name!r} needs PyTorch, which is not installed here (pip install 'fedsaddle[torch]')"
        ) from None
    if not torch.cuda.is_available():
        raise DeviceError(f"device {name!r}: this machine has no CUDA device that PyTorch can use")
    index = int(name.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {name!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return name


def choose(name: str | None) -> str:
    """Make `name` (checked) this process's device, and that of the client processes it starts; None keeps the
    environment's choice (cpu when it has none)."""
    chosen = check_available(name if name is not None else current())
    os.environ[ENVIRONMENT] = chosen
    return chosen


def current() -> str:
    """This process's device: FEDSADDLE_DEVICE, or cpu."""
    return parse(os.environ.get(ENVIRONMENT) or "cpu")
