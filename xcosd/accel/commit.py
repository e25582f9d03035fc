"""The commit rule on the device (``docs/METHODS.md``, "Choices worth knowing").

A lossy codec stays exact because both sides decide with the *committed* numbers: the
cloud commits the target's row as the device will decode it. On the accelerator path
the cloud commits on the device, so the result must be bit for bit what the device's
numpy decode gives (:mod:`xcosd.methods.commit`):

* the codec's rounding: ``f16`` and ``bf16`` (and their ``+zstd``, a lossless byte
  stage) round each float32 to nearest even, as torch's casts do on every device;
* the renormalisation: a fixed pairwise tree total (:func:`xcosd.methods.base.fixed_total`
  on the host, :func:`~xcosd.accel.sums.fixed_sum` here: the same additions in the same
  order), then one float64 division rounded to float32.

Codecs whose rounding is not a cast (``q8``'s grid, ``topk:K``'s selection) have no
device commit here: :func:`device_commit` says so, and their sessions are verified on
the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..codecs import Codec
from .sums import fixed_sum

Commit = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


_CASTS: dict[str, Commit] = {"f16": _f16, "bf16": _bf16}


def device_commit(codec: Codec) -> Commit | None:
    """``codec.commit`` as a torch function of float32 rows, or ``None`` where this
    module has none."""
    if codec.exact:
        return _identity
    inner = getattr(codec, "inner", codec)  # +zstd compresses the inner codec's bytes
    return _CASTS.get(inner.name)


def _normalise(x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """Each row over its fixed-order total (plus ``extra``), float64, to float32."""
    total = fixed_sum(x)
    if extra is not None:
        total = total + extra
    return (x.to(torch.float64) / total[:, None]).to(torch.float32)


def committed_full(commit: Commit, rows: torch.Tensor) -> torch.Tensor:
    """``p*`` of rows sent whole (straightforward): ``normalise(commit(p))``."""
    return _normalise(commit(rows))


def theta_other(rows: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``theta_o`` of each row, the float32 that crosses the link."""
    return fixed_sum(torch.where(other[None, :], rows, 0.0)).to(torch.float32)


def committed_hybrid(commit: Commit, rows: torch.Tensor, common: torch.Tensor,
                     other: torch.Tensor) -> torch.Tensor:
    """``p*`` over all target ids for methods that send ``p`` over V_C plus ``theta_o``
    (hybrid resampling, SR-DV): on V_C what the device decodes and renormalises, on
    V_O ``p``'s shape with the committed mass ``theta_o*``."""
    theta = theta_other(rows, other).to(torch.float64)
    dec = commit(rows[:, common])
    total = fixed_sum(dec) + theta
    out = torch.zeros_like(rows)
    out[:, common] = (dec.to(torch.float64) / total[:, None]).to(torch.float32)
    p_o = rows[:, other].to(torch.float64)
    mass = fixed_sum(p_o)
    scale = torch.where(mass > 0, (theta / total) / torch.where(mass > 0, mass, 1.0), 0.0)
    out[:, other] = (p_o * scale[:, None]).to(torch.float32)
    return out


__all__ = ["Commit", "committed_full", "committed_hybrid", "device_commit", "theta_other"]
