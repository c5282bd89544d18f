"""The secret challenge a verified download passes after its fingerprint check (issue 35;
:mod:`collabopt.engine.download_votes`).

The votes' fingerprint is public and has three sums: a hostile server that read the votes can send other parameters
with the same sums (a permutation of the honest ones). So the downloader then draws a secret seed and asks other
peers that voted the majority's fingerprint at the state's epoch (never the source; up to :data:`MAX_ANSWERERS`, at
once) for :func:`projection`: :data:`CHALLENGE_VECTORS` dot products of the parameters they serve with random
vectors drawn from the seed. Nobody knew the vectors when the state was sent, so only parameters close to the
answerers' agree with their answers (:func:`agrees`; the tolerance's scale: docs/decisions.md). An answer at another
epoch than the state's counts as none. :func:`challenge_refusal` accepts when more answers agree than disagree, at
least one, or one against one (with at most one hostile member a hostile source gets no agreeing answer).

The answer is computed from a copy of the parameters this peer serves (a synchronous peer's parameters, a DiLoCo
peer's anchor: what its vote fingerprints; no optimizer state), taken without waiting for a boundary
(``ConsistentStateAverager.challenge_state``) and projected off the state service's event loop
(:class:`ChallengeAnswers`). None while its state is not shared or a boundary is under way; one challenge at a time
per caller; with a swarm key only a member whose download the member check passes gets one
(:func:`collabopt.engine.member_checks.download_refusal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import torch
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine.dialback import read_message, write_message

logger = logging.getLogger(__name__)

CHALLENGE_VECTORS = 4  # dot products per challenge
MAX_VECTORS = 16  # the most a request may ask for
MAX_ANSWERERS = 4  # peers asked at once
CHALLENGE_TIMEOUT = 15.0  # seconds a downloader waits for the answers, plus PER_PARAMETER_WAIT per parameter
PER_PARAMETER_WAIT = 5e-8  # s; a projection took 0.22-0.26 s per 20M parameters (1.1-1.3e-8 s each): docs/faults.md
HOST_WAIT = 10.0  # seconds an answer waits for the host process's copy of the parameters
PROJECTION_TOLERANCE = 1e-5  # of the parameters' L2 norm (docs/decisions.md, "Downloads: a secret challenge")
MAX_WAITING = 4  # challenges a peer holds at once (one computed at a time, one per caller); more are "busy"
_CHUNK = 1 << 18  # elements per pass: the vectors' temporaries stay a few MB
_MAX_MESSAGE = 4096
ANSWER_READ_WAIT = 10.0  # seconds an answering peer keeps its end open for the caller to read the answer


class Projection(NamedTuple):
    values: list[float]  # the dot products with each vector
    norm: float  # the parameters' L2 norm (the tolerance's scale)


def new_seed() -> int:
    """A secret seed (64 random bits from the OS)."""
    return secrets.randbits(64)


@torch.no_grad()
def projection(tensors: Sequence[torch.Tensor], seed: int, vectors: int = CHALLENGE_VECTORS) -> Projection:
    """The dot products of ``tensors`` (flattened, in order) with ``vectors`` random vectors that ``seed``
    determines, summed in float64. Each weight is one of 256 levels in [-1, 1] (a random byte of a CPU
    ``torch.Generator``, drawn chunk by chunk; exact, and the same on every machine): a change of a few parameters
    (two swapped) escapes one vector with probability 1/256 (+-1 weights: 1/2)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.zeros(vectors, dtype=torch.float64)
    squares = torch.zeros((), dtype=torch.float64)
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            x = flat[start:start + _CHUNK].to(device="cpu", dtype=torch.float64)
            levels = torch.randint(0, 256, (vectors, x.numel()), generator=generator, dtype=torch.uint8)
            values += levels.to(torch.float64).sub_(127.5).div_(127.5) @ x
            squares += x.square().sum()
    return Projection([float(v) for v in values.tolist()], math.sqrt(float(squares)))


def challenge_timeout(num_parameters: int) -> float:
    """Seconds a downloader waits for the answers to a challenge of ``num_parameters`` parameters."""
    return CHALLENGE_TIMEOUT + PER_PARAMETER_WAIT * num_parameters


def agrees(answer: Sequence[float], own: Projection, tolerance: float = PROJECTION_TOLERANCE) -> bool:
    """Whether ``answer`` (a peer's dot products) is ``own`` (the downloaded parameters') to ``tolerance`` times their
    L2 norm, each value."""
    if len(answer) != len(own.values) or not all(isinstance(v, float) and math.isfinite(v) for v in answer):
        return False
    bound = tolerance * max(own.norm, 1e-30)
    return all(abs(a - b) <= bound for a, b in zip(answer, own.values, strict=True))


def challenge_refusal(answers: dict[str, Any], epoch: int, own: Projection) -> tuple[str | None, bool]:
    """Why a state of ``epoch`` whose parameters' projection is ``own`` must be refused after the challenge's
    ``answers`` (peer -> answer, None where it gave none), or None; and whether it was refused for want of answers
    at ``epoch`` (its source may be honest). Accepted: more answers agree than disagree, at least one; or one
    against one."""
    agreeing = disagreeing = 0
    for answer in answers.values():
        values = answer.get("projection") if isinstance(answer, dict) and answer.get("epoch") == epoch else None
        if isinstance(values, list):
            if agrees(values, own):
                agreeing += 1
            else:
                disagreeing += 1
    if agreeing > disagreeing or agreeing == disagreeing == 1:  # (so at least one agrees)
        return None, False
    if not agreeing and not disagreeing:
        return f"no other voter of epoch {epoch} answered its challenge (asked {len(answers)})", True
    return (f"its parameters are not those the other voters of epoch {epoch} serve (secret challenge: "
            f"{agreeing} answer(s) agree, {disagreeing} disagree)"), False


def challenge_protocol(prefix: str) -> str:
    """The libp2p protocol a peer of the state averager ``prefix`` answers challenges on."""
    return f"{prefix}::collabopt.ProjectionChallenge"


class ChallengeAnswers:
    """This peer's answers to download challenges, served by :class:`~collabopt.engine.state_service.StateService`
    on its event loop: ``state`` (a blocking call: the epoch and a copy of the parameters this peer serves, or None
    mid-boundary), ``sharing`` (whether it serves its state now) and ``refusal`` (a coroutine: with a swarm key, why
    a caller gets no answer; None where it gets one)."""

    def __init__(self, state: Callable[[], tuple[int, list[torch.Tensor]] | None], sharing: Callable[[], bool],
                 refusal: Callable[[bytes], Awaitable[str | None]]):
        self._state, self._sharing, self._refusal = state, sharing, refusal
        self._slot: asyncio.Lock | None = None
        self._waiting, self._challengers = 0, set()

    async def serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The handler of :func:`challenge_protocol`: read one request, write one answer."""
        try:
            request = MSGPackSerializer.loads(await asyncio.wait_for(read_message(reader, _MAX_MESSAGE),
                                                                     CHALLENGE_TIMEOUT))
            answer = await self.answer(request, stream_info.peer_id.to_bytes())
            await write_message(writer, MSGPackSerializer.dumps(answer))
            with contextlib.suppress(Exception):  # the caller closes first, once it has the answer (streams.py)
                await asyncio.wait_for(reader.read(), ANSWER_READ_WAIT)
        except Exception as e:
            logger.debug(f"collabopt: a download challenge from {getattr(stream_info, 'peer_id', '?')} failed: {e!r}")
        finally:
            writer.close()

    async def answer(self, request: Any, caller: bytes) -> dict[str, Any]:
        """The answer to ``request`` (seed, epoch, vectors) of ``caller``: the projection of the state this peer
        serves at that epoch, or why there is none (refused, not shared, busy, another epoch)."""
        if (not isinstance(request, dict) or type(request.get("seed")) is not int
                or type(request.get("epoch")) is not int or type(request.get("vectors")) is not int
                or not 0 <= request["seed"] < 1 << 64 or not 0 < request["vectors"] <= MAX_VECTORS):
            return dict(refused="a challenge needs a seed, an epoch and 1 to 16 vectors")
        refused = await self._refusal(caller)
        if refused is not None:
            logger.warning(f"collabopt: refused a download challenge of {PeerID(caller)}: {refused}")
            return dict(refused=refused)
        if not self._sharing():  # (a DiLoCo round in flight: its epoch and anchor disagree)
            return dict(shared=False)
        if self._waiting >= MAX_WAITING or caller in self._challengers:  # (one per caller)
            return dict(busy=True)
        self._waiting += 1
        self._challengers.add(caller)
        try:
            if self._slot is None:
                self._slot = asyncio.Lock()
            async with self._slot:
                loop = asyncio.get_running_loop()
                state = await asyncio.wait_for(loop.run_in_executor(None, self._state), HOST_WAIT)
                if state is None or state[0] != request["epoch"]:  # (mid-boundary: never waited for)
                    return dict(epoch=None if state is None else state[0])
                found = await loop.run_in_executor(None, projection, state[1], request["seed"], request["vectors"])
                return dict(epoch=state[0], projection=found.values)
        finally:
            self._waiting -= 1
            self._challengers.discard(caller)


async def ask_projections(p2p: Any, protocol: str, peers: Sequence[str], seed: int, epoch: int,
                          timeout: float = CHALLENGE_TIMEOUT) -> dict[str, Any]:
    """Ask ``peers`` (base58) at once, through ``p2p`` on ``protocol``, for the projection of the state they serve
    (``seed``; ``epoch``: the downloaded state's): their answers, None where a peer gave none within ``timeout``
    (:func:`challenge_timeout`)."""
    request = dict(seed=seed, epoch=epoch, vectors=CHALLENGE_VECTORS)

    async def ask(peer: str) -> Any:
        writer = None
        try:
            _info, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol)
            await write_message(writer, MSGPackSerializer.dumps(request))
            return MSGPackSerializer.loads(await read_message(reader, _MAX_MESSAGE))
        finally:
            if writer is not None:
                writer.close()

    async def answer_of(peer: str) -> Any:
        try:
            return await asyncio.wait_for(ask(peer), timeout)
        except Exception as e:
            logger.debug(f"collabopt: {peer} gave no answer to a download challenge ({e!r})")
            return None

    return dict(zip(peers, await asyncio.gather(*map(answer_of, peers)), strict=True))


__all__ = ["CHALLENGE_TIMEOUT", "CHALLENGE_VECTORS", "MAX_ANSWERERS", "PROJECTION_TOLERANCE", "ChallengeAnswers",
           "Projection", "agrees", "ask_projections", "challenge_protocol", "challenge_refusal", "challenge_timeout",
           "new_seed", "projection"]
