"""Robust aggregation of one all-reduce part: CenteredClip and capped member weights (issue 35).

In a butterfly all-reduce each member reduces one part of the flattened tensors and holds every group member's
copy of that part. With ``mean`` one member sending finite but hostile values (its gradients times -20, or noise
at 100x the gradient's norm) moves the average as far as it likes; the non-finite guard stops NaN/inf only.
:func:`centered_clip` bounds that pull: each member's difference from the estimate is clipped to a radius, so a
member moves the result by at most its weight share times the radius. :func:`cap_weights` keeps a member's claimed
sample count from buying it a larger weight share, and :func:`cap_progress_claims` its progress records from ending an
epoch or moving the swarm ahead.

What this does not bound: a member acting as the reducer of a part computes that part's result alone, and can
send any values back (a check across reducers, or redundant reducers, would be needed). Nor does it cover a
hostile majority of a group, or a hostile peer serving its own model to joiners (state download). Nothing here
talks to hivemind: a reducer hands in the parts it holds.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

# CenteredClip's fixed point is reached geometrically: where only a weight share q of members is clipped, each
# iteration shrinks the distance to it by a factor q (with nothing clipped one iteration gives the exact mean). q is
# below 0.5 when fewer than half the weight is hostile: 10 iterations leave under 1e-3 of the first step.
ITERATIONS = 10
# stop early once an update is this small relative to the radius (a member's pull is at most the radius)
TOLERANCE = 1e-6
# the automatic radius: this many times the distance from the start within which a majority of the members' parts
# lie (see _radius)
RADIUS_FACTOR = 1.0


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float] | None = None, *,
                  radius: float | None = None, iterations: int = ITERATIONS,
                  start: torch.Tensor | None = None) -> torch.Tensor:
    """CenteredClip (Karimireddy, He, Jaggi 2021; BTARD, Gorbunov et al. 2022) of same-shape ``parts``, one a member.

    Iterates ``v <- v + sum_i w_i (x_i - v) min(1, radius / ||x_i - v||) / sum_i w_i`` from ``start`` (default: the
    coordinate-wise median of the members' parts, which a minority of members cannot move outside the honest
    range, and which no weight claim moves), at most ``iterations`` times, stopping once an update is below
    ``TOLERANCE`` times the radius. Where every part lies within ``radius`` of the estimate, the result is the
    weighted mean. ``radius=None`` picks it from the parts (:data:`RADIUS_FACTOR` times the distance from the
    start within which a majority of the parts lie). A member of weight 0 takes no part; a single member's part is
    returned as is.

    Computes in float32 (float64 for float64 parts) and returns the parts' dtype. Memory: the members' parts stacked
    (members x part size, in the compute dtype) plus a few part-sized temporaries.

    Raises ValueError for no parts, mismatched shapes, negative or non-finite weights, all weights zero, or a
    non-finite value in a taking-part member's part (naming the member: the non-finite guard handles those)."""
    if not parts:
        raise ValueError("centered_clip needs at least one part")
    first = parts[0]
    if not first.is_floating_point():
        raise ValueError(f"centered_clip needs floating-point parts, got {first.dtype}")
    for index, part in enumerate(parts):
        if part.shape != first.shape or part.dtype != first.dtype or part.device != first.device:
            raise ValueError(f"member {index}'s part is {part.dtype} {tuple(part.shape)} on {part.device}, member 0's "
                             f"{first.dtype} {tuple(first.shape)} on {first.device}")
    weights = [1.0] * len(parts) if weights is None else _checked_weights(weights)
    if len(weights) != len(parts):
        raise ValueError(f"{len(weights)} weights for {len(parts)} parts")
    members = [index for index, weight in enumerate(weights) if weight > 0.0]
    if not members:
        raise ValueError("every member's weight is 0: no part to aggregate")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    dtype = torch.float64 if first.dtype == torch.float64 else torch.float32

    stacked = torch.stack([parts[index].reshape(-1).to(dtype) for index in members])
    finite = torch.isfinite(stacked).all(dim=1)
    if not bool(finite.all()):
        bad = members[int((~finite).nonzero()[0])]
        raise ValueError(f"member {bad}'s part holds non-finite values (the non-finite guard refuses those)")
    if len(members) == 1:
        return parts[members[0]].clone()
    w = torch.tensor([weights[index] for index in members], dtype=dtype, device=stacked.device)
    w = w / w.sum()

    if start is None:
        v = _coordinate_median(stacked)
    else:
        if start.shape != first.shape:
            raise ValueError(f"start is {tuple(start.shape)}, the parts {tuple(first.shape)}")
        v = start.reshape(-1).to(dtype=dtype, device=stacked.device)
        if not bool(torch.isfinite(v).all()):
            raise ValueError("start holds non-finite values")
    tau = _radius(stacked, v) if radius is None else float(radius)
    if not tau >= 0.0:
        raise ValueError(f"radius must be >= 0, got {radius}")
    if tau == 0.0:  # (every member's part equals the start: nothing moves it)
        return v.reshape(first.shape).to(first.dtype)
    for _ in range(iterations):
        differences = stacked - v
        distances = torch.linalg.vector_norm(differences, dim=1)
        # min(1, tau / d); where d <= tau the factor is 1, so d = 0 never divides
        scale = torch.where(distances > tau, tau / distances.clamp_min(torch.finfo(dtype).tiny), 1.0)
        update = (w * scale) @ differences
        v = v + update
        if float(torch.linalg.vector_norm(update)) <= TOLERANCE * tau:
            break
    return v.reshape(first.shape).to(first.dtype)


def _checked_weights(weights: Sequence[float]) -> list[float]:
    """``weights`` as floats; a ValueError naming the member whose weight is negative, NaN or infinite."""
    values = [float(weight) for weight in weights]
    for index, weight in enumerate(values):
        if not weight >= 0.0 or weight == float("inf"):
            raise ValueError(f"member {index}'s weight is {weight}: weights must be finite and >= 0")
    return values


def _coordinate_median(stacked: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of the rows (the mean of the two middle values for an even count): with fewer than
    half of the rows hostile, each coordinate lies within the honest rows' range."""
    ordered = stacked.sort(dim=0).values
    count = ordered.shape[0]
    return (ordered[(count - 1) // 2] + ordered[count // 2]) / 2


def _radius(stacked: torch.Tensor, start: torch.Tensor) -> float:
    """:data:`RADIUS_FACTOR` times the smallest distance ``||x_i - start||`` within which a majority of the members
    lie (of 4 members: the third smallest; of 3 or 5: the median).

    With fewer than half of the members hostile that is an honest member's distance or a closer hostile one's, so a
    hostile member's pull is bounded by the honest spread, not by its own distance: it moves the result by its
    weight share of the others' times the radius. Where one member of a group is far, the others stay unclipped
    (an all-honest group whose members lie alike gets nearly their mean: only members beyond the majority's
    distance are clipped, and by little). Factor 1, not 2: the bias a hostile member leaves grows with the radius
    (measured: docs/faults.md). Members taken unweighted: a weight claim does not move it."""
    distances = torch.linalg.vector_norm(stacked - start, dim=1).sort().values
    return RADIUS_FACTOR * float(distances[len(distances) // 2])


def cap_weights(weights: Sequence[float], factor: float = 2.0) -> list[float]:
    """Each member's weight capped at ``factor`` times the median of the positive weights.

    A member's weight is the sample count it claims, which nobody checks: capped, a claim of 1,000x its real samples
    buys it at most ``factor`` x the typical member's share, and honest members with batch sizes within ``factor``
    of the median keep theirs. With fewer than half of the members hostile the median is an honest member's claim.
    Weights of 0 (members taking no part) stay 0 and do not count toward the median."""
    if not factor >= 1.0:
        raise ValueError(f"factor must be >= 1 (below it the median member is capped too), got {factor}")
    values = _checked_weights(weights)
    positive = [weight for weight in values if weight > 0.0]
    if not positive:
        return values
    cap = factor * statistics.median(positive)
    return [min(weight, cap) for weight in values]


def cap_progress_claims(records: Sequence[dict], local_epoch: int, own_peer_id: bytes | None = None,
                        factor: float = 2.0) -> list[dict | None]:
    """A swarm's progress records (hivemind's ``LocalTrainingProgress`` as dicts) as a peer may count them when
    no single member may end an epoch or move the swarm ahead by its claims alone.

    * An epoch ahead of ``local_epoch`` counts only once at least half of the training peers (this peer included,
      its own record ``own_peer_id`` not counted twice) report it or a later one; a record of an epoch beyond that is
      left out (``None`` in its place; the others are copies, in order). hivemind takes the largest epoch of any
      record: one record could move every peer ahead.
    * Each record's ``samples_accumulated`` at the swarm's epoch is capped at ``factor`` times the median of those
      records' counts (zeros included, so a claim made before the others report counts nothing), and each
      ``samples_per_second`` at ``factor`` times the median rate. hivemind sums them: one claim of 1,000x the
      target ends the epoch at once.

    With fewer than half of the peers hostile both medians are honest peers'. The price: an honest peer more than
    ``factor`` times faster than the median is counted as if it were not, so an epoch then gathers more samples
    than the target; a peer that alone finished a round others missed is not followed until half of them did."""
    values = [dict(record) for record in records]
    voters = [local_epoch] + [int(record["epoch"]) for record in values
                              if not record.get("client_mode") and record.get("peer_id") != own_peer_id]
    voters.sort(reverse=True)
    epoch = max(local_epoch, voters[(len(voters) + 1) // 2 - 1])
    kept = [record for record in values if record.get("client_mode") or int(record["epoch"]) <= epoch]
    counts = [int(record["samples_accumulated"]) for record in kept if int(record["epoch"]) == epoch]
    count_cap = int(factor * statistics.median(counts)) if counts else 0
    rates = [float(record["samples_per_second"]) for record in kept]
    rate_cap = factor * statistics.median(rates) if rates else 0.0
    for record in kept:
        record["samples_per_second"] = min(float(record["samples_per_second"]), rate_cap)
        if int(record["epoch"]) == epoch:
            record["samples_accumulated"] = min(int(record["samples_accumulated"]), count_cap)
    return [record if any(record is other for other in kept) else None for record in values]
