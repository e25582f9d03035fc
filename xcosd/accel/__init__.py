"""Verification next to the logits: the server's half of a round in torch, on the
target's device, for a whole batch of sessions at once (:func:`verify_batch`).

Needs torch (the ``models`` extra); nothing else in xcosd imports this package unless
the cloud's target is a torch model verified on its device.
"""

from __future__ import annotations

from .verify import DeviceReject, Round, on_request, supported, verify_batch

__all__ = ["DeviceReject", "Round", "on_request", "supported", "verify_batch"]
