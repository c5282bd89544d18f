"""A peer's error-feedback buffer for compressed pseudo-gradients: what the compression drops is sent later.

SparseLoCo (arXiv 2508.15706) keeps one buffer ``e`` a peer, in host memory, and in each round sends
``compress(decay * e + delta)``, keeping the rest::

    e    <- decay * e + delta          (delta: this round's pseudo-gradient, anchor - parameters)
    sent <- decode(encode(e))          (what every member will decode from the payload)
    e    <- e - sent

With ``decay = 1`` the sum of everything sent plus the buffer equals the sum of the pseudo-gradients: nothing is
lost for good. Below 1 the buffer also plays the part of DiLoCo's outer momentum (SparseLoCo and templar use 0.95
with a plain SGD outer step, no momentum).

Rules, and why:

* A round's update of the buffer takes effect only once the round is applied (:meth:`ErrorFeedback.commit`);
  :meth:`ErrorFeedback.discard` drops it. Why: a peer whose round is not applied keeps its pseudo-gradient (its
  parameters stay apart from the anchor), and the next round's pseudo-gradient holds it again; a buffer that had
  already given up the part it sent would send that part twice.
* A peer that does not apply a round its payload may have reached (the others may apply it) does not know yet which
  holds: :meth:`ErrorFeedback.hold` keeps the update staged until it learns, from a state download of a later epoch
  (:meth:`collabopt.diloco.DiLoCo.restore_after_download`). Applied by the others: :meth:`~ErrorFeedback.commit`
  (what the payload sent is in the swarm's anchor, the buffer keeps the rest, as the peer keeps only its progress
  made since). Not applied: :meth:`~ErrorFeedback.discard` (the peer's parameters still hold the pseudo-gradient,
  which its next round sends again). Dropping the update at once would lose for good what the compression left out
  where the others applied the round, and count twice what the old buffer had sent.
* A round applied without this peer's payload (the robust aggregate left it out:
  :func:`collabopt.sparse_aggregation.trim_disagreeing`) moves the peer to the new anchor like the others, so its
  progress of that round leaves its parameters: :meth:`~ErrorFeedback.commit_unsent` keeps all of it in the buffer,
  the part the payload sent included, and the next rounds send it.
* A round applied while this peer waited (not one of its contributors: ``SparseLoCo.max_contributors``) moves it
  to the new anchor too: :meth:`~ErrorFeedback.defer` keeps all of its pseudo-gradient, without the decay (``e +
  delta``): the decay plays momentum's part over the rounds a peer sends in, and a peer that waits several rounds
  would otherwise lose a share of its progress for each (about 19% of it after four at 0.95).
* :meth:`~ErrorFeedback.compress` builds on the committed buffer: an update still staged or held is dropped, its
  round taken as not applied (as the peer does when it sends again: its pseudo-gradient since its anchor, whole).

The buffer is the peer's own: a checkpoint holds the committed buffer (:meth:`~ErrorFeedback.state_dict`; a staged
or held update is not saved: a checkpoint holds the buffer of the rounds known to be applied), a state download does
not (a joiner starts with zeros).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from collabopt.sparse_codec import SparseCodec

logger = logging.getLogger(__name__)

STATE_VERSION = 1


class ErrorFeedback:
    """The error-feedback buffer of one peer for tensors of ``shapes``, compressed by ``codec``."""

    def __init__(self, codec: SparseCodec, shapes: Sequence[Sequence[int]], decay: float = 0.95):
        if not (isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0.0 <= decay <= 1.0):
            raise ValueError(f"decay must be a number in [0, 1], got {decay!r}")
        self.codec = codec
        self.shapes = [tuple(int(size) for size in shape) for shape in shapes]
        self.decay = float(decay)
        self.buffers = [torch.zeros(shape, dtype=torch.float32) for shape in self.shapes]
        self._staged: list[torch.Tensor] | None = None
        self._payload = b""  # the staged update's payload (commit_unsent adds back what it sent)
        self._held = False  # the staged update waits for news of a round others may have applied (hold())

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def compress(self, pseudo_gradient: Sequence[torch.Tensor]) -> bytes:
        """This round's payload for ``pseudo_gradient`` (tensors of :attr:`shapes`, any device and float dtype),
        built on the committed buffer; the buffer's update is staged until :meth:`commit`. An update still staged or
        held is dropped: its round is taken as not applied (see the module docstring)."""
        if len(pseudo_gradient) != len(self.shapes):
            raise ValueError(f"{len(pseudo_gradient)} tensors for a buffer of {len(self.shapes)}")
        staged = []
        for buffer, delta, shape in zip(self.buffers, pseudo_gradient, self.shapes, strict=True):
            if tuple(delta.shape) != shape:
                raise ValueError(f"a tensor of shape {tuple(delta.shape)} for a buffer of {shape}")
            staged.append(buffer * self.decay + delta.detach().to(device="cpu", dtype=torch.float32))
        payload = self.codec.encode(staged)
        for buffer, sent in zip(staged, self.codec.decode(payload, self.shapes), strict=True):
            buffer.sub_(sent)
        if self._held:
            logger.info("collabopt: a new round's payload before the download that tells whether the others applied "
                        "the last one: that round is taken as not applied (its error-feedback update dropped)")
        self._staged, self._held, self._payload = staged, False, payload
        return payload

    @property
    def staged(self) -> bool:
        """Whether a payload's update of the buffer waits for :meth:`commit` or :meth:`discard`."""
        return self._staged is not None

    @property
    def held(self) -> bool:
        """Whether the staged update waits for news of a round this peer did not apply but others may have
        (:meth:`hold`)."""
        return self._held

    def hold(self) -> None:
        """The round that sent the last payload is not applied here, but the payload may have reached members that
        apply it: the update stays staged until this peer learns which (:meth:`commit`: they applied it;
        :meth:`discard`: they did not)."""
        if self._staged is None:
            raise RuntimeError("no payload to hold: call compress() first (once per round)")
        self._held = True

    def commit(self) -> None:
        """The round that sent the last payload was applied: the buffer keeps what it did not send."""
        if self._staged is None:
            raise RuntimeError("no payload to commit: call compress() first (once per round)")
        self.buffers, self._staged, self._held = self._staged, None, False

    def commit_unsent(self) -> None:
        """The round that sent the last payload was applied without it (left out by the robust aggregate): the
        buffer keeps all of this round's update, what the payload sent included."""
        if self._staged is None:
            raise RuntimeError("no payload to commit: call compress() first (once per round)")
        for buffer, sent in zip(self._staged, self.codec.decode(self._payload, self.shapes), strict=True):
            buffer.add_(sent)
        self.commit()

    def defer(self) -> None:
        """The round was applied while this peer waited (not one of its contributors, ``max_contributors``): the
        buffer keeps all of this round's pseudo-gradient, undecayed (``e + delta``): the round did not take place for
        the buffer, whose decay counts the rounds it sent in."""
        if self._staged is None:
            raise RuntimeError("no payload to defer: call compress() first (once per round)")
        sent = self.codec.decode(self._payload, self.shapes)
        for buffer, old, part in zip(self._staged, self.buffers, sent, strict=True):
            buffer.add_(part).add_(old, alpha=1.0 - self.decay)  # (decay * e + delta, then + (1 - decay) * e)
        self.commit()

    def discard(self) -> None:
        """The round was not applied: the buffer stays as it was before :meth:`compress`."""
        self._staged, self._held = None, False

    def reset(self) -> None:
        """Zeros (a fresh start, e.g. the parameters were replaced by a downloaded state)."""
        self.buffers = [torch.zeros(shape, dtype=torch.float32) for shape in self.shapes]
        self._staged, self._held = None, False

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The committed buffer and the settings it was built with. A staged or held update is not saved: its round
        is not known to be applied, and a checkpoint's parameters hold that round's pseudo-gradient still."""
        return {"version": STATE_VERSION, "decay": self.decay, "shapes": [list(shape) for shape in self.shapes],
                "codec": {"density": self.codec.density, "chunk_size": self.codec.chunk_size,
                          "bits": self.codec.bits},
                "buffers": [buffer.clone() for buffer in self.buffers]}

    def load_state_dict(self, state: Mapping[str, Any], names: Sequence[str] | None = None) -> None:
        """Restore a buffer saved by :meth:`state_dict` for the same model. The saved buffer's values are taken as
        they are; the settings are this object's (a checkpoint taken with another density or decay still holds
        what was not sent). Raises ValueError, naming the parameter (``names[i]`` where given), for another format
        version, another number of tensors, a tensor of another shape or dtype (float32), or NaN/inf."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            version = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"error-feedback state of version {version!r}, expected {STATE_VERSION}")
        shapes = [tuple(shape) for shape in state.get("shapes", self.shapes)]
        if shapes != self.shapes:
            raise ValueError(f"the saved error-feedback buffer is for shapes {shapes}, this model's are {self.shapes}")
        saved = list(state.get("buffers") or [])
        if len(saved) != len(self.shapes):
            raise ValueError(f"the saved error-feedback buffer holds {len(saved)} tensors, this model has "
                             f"{len(self.shapes)} parameters")
        for index, (buffer, shape) in enumerate(zip(saved, self.shapes, strict=True)):
            label = f"parameter {index}" + (f" ({names[index]})" if names and index < len(names) else "")
            if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.float32 or tuple(buffer.shape) != shape:
                found = (f"{buffer.dtype} {tuple(buffer.shape)}" if isinstance(buffer, torch.Tensor)
                         else type(buffer).__name__)
                raise ValueError(f"the saved error-feedback buffer of {label} is {found}, this model's is "
                                 f"torch.float32 {shape}")
            if not bool(torch.isfinite(buffer).all()):
                raise ValueError(f"the saved error-feedback buffer of {label} holds NaN/inf")
        self.buffers = [buffer.detach().to("cpu").clone() for buffer in saved]
        self._staged, self._held = None, False

__all__ = ["STATE_VERSION", "ErrorFeedback"]
