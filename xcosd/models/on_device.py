"""Any model's rows, handed over as torch tensors on a chosen device.

The cloud verifies next to the logits when its target offers ``score_tensors``
(:meth:`~xcosd.models.transformers_model.TransformersModel.score_tensors` does, on its
own device). :class:`OnDevice` gives the same to a model that computes its rows in
numpy (the n-gram, table and synthetic models, whose laws the tests know exactly), so
the accelerator path's verification (xcosd/accel/) runs on them unchanged: on the CPU
device in CI, on a GPU where there is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from .base import LanguageModel, ModelWrapper, Session


def torch_device(name: str | torch.device) -> torch.device:
    """``name`` as a torch device, with a clear error when it is not on this machine."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ModelError(f"unknown device {name!r}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelError(f"device {name!r}: torch sees no CUDA device on this machine "
                             f"(torch {torch.__version__}, built "
                             f"{'with' if torch.version.cuda else 'without'} CUDA)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelError(f"device {name!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ModelError(f"device {name!r}: MPS is not available on this machine")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ModelError(f"device {name!r}: only cpu, cuda and mps are supported")
    return dev


class OnDevice(ModelWrapper):
    """``model``, whose :meth:`score_tensors` puts each session's rows on ``device``
    (every other call goes to ``model``)."""

    def __init__(self, model: LanguageModel, device: str | torch.device = "cpu") -> None:
        super().__init__(model)
        self.device = torch_device(device)

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r}, {self.device})"

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def score_tensors(self, batch: Sequence[tuple[Session, Sequence[int]]]
                      ) -> list[torch.Tensor]:
        return [torch.from_numpy(np.ascontiguousarray(r, dtype=np.float32)).to(self.device)
                for r in self.inner.score(batch)]

    def score_tree_tensors(self, session: Session, parents: Sequence[int],
                           ids: Sequence[int]) -> torch.Tensor:
        """A draft tree's rows (:func:`~xcosd.models.tree_scoring.score_tree`) on
        ``device``."""
        from .tree_scoring import score_tree

        rows = score_tree(self.inner, session, parents, ids)
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(self.device)


__all__ = ["OnDevice", "torch_device"]
