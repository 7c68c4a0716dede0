"""Make torchvision importable on the CPU build of torch (imported before torchvision or
``streaming``).

torchvision's PyPI wheels are CUDA-linked: its C extension does not load on CPU torch, and its
Python side then fails registering fake kernels for operators nobody defined (``operator
torchvision::nms does not exist``). Declaring the two operators first lets the import go through;
torchvision then registers its Python implementations against them. Nothing here runs a torchvision
C operator (the transforms and ``FakeData`` the tests use are pure Python and torch).
"""

from __future__ import annotations

import torch

_LIBRARY = torch.library.Library("torchvision", "DEF")
for _name in ("nms", "qnms"):
    _LIBRARY.define(f"{_name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
