"""B7's figures from its peers' records, their fits in N, and the report ``scale.{json,md,png}`` (see
:mod:`benchmarks.scale`)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import dht_traffic
from benchmarks.boundary import boundary_split
from benchmarks.common import median, spread

NOTES = "<!-- Below this line: written by hand, kept when benchmarks.scale writes the report again. -->"
CPU_KINDS = ("dht", "averagers", "p2pd", "main")
UNSATURATED = 0.9  # the machine's busy share up to which a size counts in the second fit
# (key, label) of every figure fitted in N; the row holds it under the key (CPU: under cpu_per_epoch)
FIGURES = (
    ("dht_sent_per_epoch", "DHT bytes sent / peer / epoch"),
    ("dht_received_per_epoch", "DHT bytes received / peer / epoch"),
    ("dht_bytes_per_s", "DHT bytes (both ways) / peer / s"),
    ("dht_calls_per_epoch", "DHT RPCs / peer / epoch"),
    ("progress_fetches_per_epoch", "progress fetches / peer / epoch"),
    ("cpu_dht", "CPU s / epoch, DHT process"),
    ("cpu_averagers", "CPU s / epoch, averager processes"),
    ("cpu_p2pd", "CPU s / epoch, p2pd"),
    ("cpu_main", "CPU s / epoch, training process"),
    ("swarm_cores", "CPU cores busy with the swarm"),
    ("epoch_s", "epoch s"),
    ("boundary_s", "epoch boundary s"),
    ("epoch_fill", "samples per epoch / target (median)"),
    ("group_size_median", "group size (median)"),
    ("joiner_download_s", "late joiners: download s (slowest)"),
    ("joiner_synced_s", "late joiners: join to synced s (slowest)"),
)


def _member(record: dict[str, Any]) -> dict[str, Any]:
    """One member's figures over its window."""
    m0, m1 = record["marks"]
    epochs, wall = max(1, m1["epoch"] - m0["epoch"]), m1["time"] - m0["time"]
    traffic = dht_traffic.difference(m1["dht"], m0["dht"])
    sent = sum(map(dht_traffic.sent, traffic.values()))
    received = sum(map(dht_traffic.received, traffic.values()))
    calls = {key: (m1["calls"].get(key, 0) - m0["calls"].get(key, 0)) / epochs for key in m1["calls"]}
    return dict(
        epochs=epochs, epoch_s=wall / epochs, sent=sent / epochs, received=received / epochs,
        bytes_per_s=(sent + received) / wall,
        calls=sum(v["calls_out"] + v["calls_in"] for v in traffic.values()) / epochs,
        by_category={cat: (dht_traffic.sent(v) + dht_traffic.received(v)) / epochs for cat, v in traffic.items()},
        cpu={kind: (m1["cpu"][kind] - m0["cpu"][kind]) / epochs for kind in m0["cpu"]},
        fetches=calls.get("get progress", 0.0), calls_main=calls,
        # per get or store of the key by the training process: the RPCs it took, the bytes of each response; and the
        # bytes of each response this peer served to others
        per_call={cat: dict(rpcs=_ratio(traffic[cat]["calls_out"] / epochs,
                                        calls.get(f"get {cat}", 0.0) + calls.get(f"store {cat}", 0.0)),
                            response_bytes=_ratio(traffic[cat]["responses_received"], traffic[cat]["calls_out"]),
                            served_response_bytes=_ratio(traffic[cat]["responses_sent"], traffic[cat]["calls_in"]),
                            served_per_epoch=traffic[cat]["calls_in"] / epochs)
                  for cat in ("progress", "metrics")},
        boundary=boundary_split(record, m0["time"], m1["time"])["boundary"],
        samples=_samples_per_epoch(record, m0["epoch"], m1["epoch"]), window=range(m0["epoch"], m1["epoch"]),
        rounds=[r for r in record["rounds"] if m0["time"] < r["time"] <= m1["time"]],
    )


def _samples_per_epoch(record: dict[str, Any], first: int, end: int) -> dict[int, int]:
    """The samples this member accumulated in each epoch of ``first .. end - 1``: a step counts in the epoch it began
    in (the epoch the step before it ended in), so the step that ends an epoch is that epoch's last."""
    counts: Counter[int] = Counter()
    epochs_after = [step[3] for step in record["steps"]]
    for began_in in epochs_after[:-1]:  # the epoch each next step began in
        if first <= began_in < end:
            counts[began_in] += record.get("batch", 0)
    return dict(counts)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _joiner(record: dict[str, Any]) -> dict[str, float] | None:
    if record.get("error") or record.get("synced") is None or not record.get("downloads"):
        return None
    return dict(download=sum(end - start for start, end, _ in record["downloads"]),
                synced=record["synced"] - record["joined"], build=record["built"] - record["joined"])


def summarize(n: int, records: list[dict[str, Any]], joiners: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of a swarm of ``n`` peers: medians over its members (ranges min..max) and its joiners' times."""
    errors = [r["error"][:300] for r in records + joiners if r.get("error")]
    members = [_member(r) for r in records if not r.get("error")]
    if not members:
        return dict(peers=n, error="; ".join(errors[:3]) or "no member record")
    rounds = [r for m in members for r in m["rounds"]]
    swarm_samples: Counter[int] = Counter()  # epochs every member measured: the swarm's samples in each
    for m in members:
        swarm_samples.update(m["samples"])
    measured = [e for e in swarm_samples if all(e in m["window"] for m in members)]
    target = records[0].get("target_batch_size") if records else None
    filled = [swarm_samples[e] / target for e in measured] if target else []
    boundaries = [b for m in members for b in m["boundary"]]
    late = [j for j in map(_joiner, joiners) if j is not None]

    def med(key: str) -> float:
        return median([m[key] for m in members])

    row: dict[str, Any] = dict(
        peers=n, members_measured=len(members), epochs=med("epochs"), epoch_s=med("epoch_s"),
        dht_sent_per_epoch=med("sent"), dht_sent_range=spread([m["sent"] for m in members]),
        dht_received_per_epoch=med("received"), dht_received_range=spread([m["received"] for m in members]),
        dht_bytes_per_s=med("bytes_per_s"), dht_calls_per_epoch=med("calls"),
        dht_by_category={cat: median([m["by_category"][cat] for m in members]) for cat in dht_traffic.CATEGORIES},
        progress_fetches_per_epoch=med("fetches"),
        per_call={cat: {k: median([m["per_call"][cat][k] for m in members]) for k in members[0]["per_call"][cat]}
                  for cat in members[0]["per_call"]},
        training_process_calls_per_epoch={key: median([m["calls_main"].get(key, 0.0) for m in members])
                                          for key in sorted({k for m in members for k in m["calls_main"]})},
        cpu_per_epoch={kind: median([m["cpu"][kind] for m in members]) for kind in members[0]["cpu"]},
        boundary_s=median(boundaries), boundary_range=spread(boundaries), boundaries=len(boundaries),
        epoch_fill=median(filled), epoch_fill_max=max(filled, default=float("nan")),
        group_sizes=dict(sorted(Counter(r["group_size"] for r in rounds).items())),
        group_size_median=median([r["group_size"] for r in rounds]),
        full_groups=sum(r["group_size"] == n for r in rounds) / len(rounds) if rounds else float("nan"),
        reasons=dict(Counter(r["reason"] for r in rounds)),
        parameter_rounds_failed=sum(r["parameters_averaged"] is False for r in rounds),
        joiners=len(joiners), joiners_synced=len(late),
        joiner_download_s=max((j["download"] for j in late), default=float("nan")),
        joiner_download_median_s=median([j["download"] for j in late]),
        joiner_synced_s=max((j["synced"] for j in late), default=float("nan")),
        joiner_build_s=median([j["build"] for j in late]),
    )
    # CPU cores the swarm's processes kept busy (DHT, averagers, p2pd, training) in the measured epochs
    row["swarm_cores"] = n * sum(row["cpu_per_epoch"].values()) / row["epoch_s"]
    if errors:
        row["peer_errors"] = errors
    return row


def value(row: dict[str, Any], key: str) -> float:
    """A fitted figure of a row (NaN where missing)."""
    if key.startswith("cpu_"):
        return float(row.get("cpu_per_epoch", {}).get(key[4:], float("nan")))
    return float(row.get(key, float("nan")))


def fit(ns: list[int], values: list[float]) -> tuple[float, float] | None:
    """``(a, b)`` of ``value = a * N^b`` by least squares on log-log (points <= 0 or NaN left out); None if fewer
    than two points."""
    points = [(math.log(n), math.log(v)) for n, v in zip(ns, values, strict=True) if v == v and v > 0]
    if len(points) < 2:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return math.exp(my - b * mx), b


def fits(rows: list[dict[str, Any]], max_busy: float | None = None) -> dict[str, dict[str, float]]:
    """Every figure's fit over the rows without an error (and, given ``max_busy``, whose machine was at most that
    busy: a saturated machine stretches every time)."""
    ok = [row for row in rows if "error" not in row and (max_busy is None or row.get("machine_busy", 1.0) <= max_busy)]
    ns = [row["peers"] for row in ok]
    out = {}
    for key, _ in FIGURES:
        found = fit(ns, [value(row, key) for row in ok])
        if found is not None:
            out[key] = dict(a=found[0], b=found[1])
    return out


def one_line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"failed: {row['error'][:200]}"
    return (f"DHT {row['dht_sent_per_epoch'] / 1e3:.0f} kB sent + {row['dht_received_per_epoch'] / 1e3:.0f} kB "
            f"received / epoch, CPU DHT {row['cpu_per_epoch']['dht']:.2f} s / epoch, boundary {row['boundary_s']:.2f} "
            f"s, groups {row['group_sizes']}, joiners {row['joiners_synced']}/{row['joiners']} in "
            f"{row['joiner_synced_s']:.1f} s")


def _f(x: Any, digits: int = 2) -> str:
    return "-" if not isinstance(x, (int, float)) or x != x else f"{x:,.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    """The generated part of scale.md: setup, the tables per N, the fits."""
    m, c, rows = results["machine"], results["config"], results["rows"]
    ok = [row for row in rows if "error" not in row]
    lines = [
        "# B7 scale: what a swarm of N peers costs each peer" + (" (smoke run: figures mean little)"
                                                                 if c.get("smoke") else ""),
        "",
        f"{m['date_utc']} · {m['cpu']} · {m['cpus']} CPUs · load avg {m['load_avg_1m_at_start']} at start · "
        f"Python {m['python']} · torch {m['torch']} · hivemind {m['hivemind']} · collabopt {m['collabopt']} "
        f"(git {m['git_commit'] or '?'})" + (f" · some rows from earlier runs ({', '.join(m['earlier_runs'])})"
                                              if m.get("earlier_runs") else ""),
        "",
        f"`python -m benchmarks.scale`: N peers on loopback, each an OS process, every peer a full DHT peer, model "
        f"`Linear(16, 4)`, synchronous mode, batch {c['batch']} per step after {c['compute_seconds']} s of simulated "
        f"compute (sleep), `target_batch_size` {c['target_batch_size']} at every N, `matchmaking_time` "
        f"{c['matchmaking_time']} s, `averaging_timeout` {c['averaging_timeout']} s. Per peer: {c['measure_epochs']} "
        f"global epochs measured after {c['warmup_epochs']} of warm-up; medians over the peers (range min..max). "
        f"Then {c['joiners']} late joiners start their optimizers at once (Python, torch and hivemind already loaded).",
        "",
        "| N | epoch s | DHT kB sent / epoch | range | DHT kB received / epoch | range | DHT kB/s | RPCs / epoch | "
        "progress fetches / epoch | boundary s | range | samples / target (median, max) | group sizes (rounds) | "
        "joiners: download s (median, slowest) | join to synced s (slowest) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['peers']} | failed: {row['error'][:300]} |" + " |" * 13)
            continue
        lines.append(
            f"| {row['peers']} | {_f(row['epoch_s'], 1)} | {_f(row['dht_sent_per_epoch'] / 1e3, 1)} | "
            f"{_kb(row['dht_sent_range'])} | {_f(row['dht_received_per_epoch'] / 1e3, 1)} | "
            f"{_kb(row['dht_received_range'])} | {_f(row['dht_bytes_per_s'] / 1e3, 1)} | "
            f"{_f(row['dht_calls_per_epoch'], 0)} | {_f(row['progress_fetches_per_epoch'], 1)} | "
            f"{_f(row['boundary_s'])} | {row['boundary_range']} | {_f(row.get('epoch_fill', math.nan), 3)}, "
            f"{_f(row.get('epoch_fill_max', math.nan), 3)} | {_groups(row['group_sizes'])} | "
            f"{_f(row['joiner_download_median_s'])}, {_f(row['joiner_download_s'])} | "
            f"{_f(row['joiner_synced_s'])} ({row['joiners_synced']}/{row['joiners']} synced) |")
    lines += ["", "DHT kB per peer per epoch by key (sent + received):", "",
              "| N | " + " | ".join(dht_traffic.CATEGORIES) + " |", "|---|" + "---|" * len(dht_traffic.CATEGORIES)]
    lines += [f"| {row['peers']} | " + " | ".join(_f(row["dht_by_category"][cat] / 1e3, 1)
                                               for cat in dht_traffic.CATEGORIES) + " |" for row in ok]
    lines += ["", "DHT calls of the training process per epoch (progress tracker, metrics reporter):", "",
              "| N | calls |", "|---|---|"]
    lines += [f"| {row['peers']} | " + ", ".join(f"{k}: {v:.1f}" for k, v in row["training_process_calls_per_epoch"]
                                                 .items()) + " |" for row in ok]
    lines += ["", "What one get or store of a record costs (progress: the tracker's fetches and reports; metrics: the "
              "metrics reporter's stores): RPCs per call, bytes per response received; responses this peer served "
              "to others per epoch, bytes each:", "",
              "| N | progress RPCs / call | bytes / response | served / epoch | bytes / served response | "
              "metrics RPCs / store | bytes / response | served / epoch | bytes / served response |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {row['peers']} | " + " | ".join(
        f"{_f(c['rpcs'], 1)} | {_f(c['response_bytes'], 0)} | {_f(c['served_per_epoch'], 0)} | "
        f"{_f(c['served_response_bytes'], 0)}" for c in (row["per_call"]["progress"], row["per_call"]["metrics"]))
        + " |" for row in ok if "per_call" in row]
    lines += ["", "CPU seconds per peer per epoch, by process:", "",
              "| N | " + " | ".join(CPU_KINDS) + " | swarm's CPU cores | machine busy | rounds (reasons) | "
              "parameter rounds failed |", "|---|" + "---|" * (len(CPU_KINDS) + 4)]
    lines += [f"| {row['peers']} | " + " | ".join(_f(row["cpu_per_epoch"].get(kind), 3) for kind in CPU_KINDS)
              + f" | {_f(row['swarm_cores'])} | {_f(row.get('machine_busy', float('nan')) * 100, 0)}% | "
              f"{_groups(row['reasons'])} | {row['parameter_rounds_failed']} |" for row in ok]
    lines += ["", "Fits `a * N^b` (least squares on log-log over the N measured; b' over the sizes whose machine was "
              f"at most {UNSATURATED:.0%} busy):", "",
              "| figure | b (exponent) | a | b' | " + " | ".join(f"N={row['peers']}" for row in ok) + " |",
              "|---|---|---|---|" + "---|" * len(ok)]
    found, calm = fits(rows), fits(rows, UNSATURATED)
    for key, label in FIGURES:
        if key in found:
            lines.append(f"| {label} | {found[key]['b']:.2f} | {found[key]['a']:.3g} | "
                         f"{_f(calm.get(key, {}).get('b'))} | "
                         + " | ".join(_f(value(row, key), 3 if key.startswith("cpu") else 2) for row in ok) + " |")
    return "\n".join(lines) + "\n"


def _kb(text: str) -> str:
    try:
        low, high = (float(x) / 1e3 for x in text.split(".."))
    except ValueError:
        return text
    return f"{low:.1f}..{high:.1f}"


def _groups(counts: dict[Any, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items()) or "-"


def plot(results: dict[str, Any], path: Path) -> bool:
    """Log-log panels of the figures against N, with their fits; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [row for row in results["rows"] if "error" not in row]
    if not ok:
        return False
    ns = [row["peers"] for row in ok]
    found = fits(results["rows"])
    panels = [("DHT bytes / peer / epoch", ["dht_sent_per_epoch", "dht_received_per_epoch"]),
              ("DHT bytes / peer / s", ["dht_bytes_per_s"]),
              ("CPU s / peer / epoch", ["cpu_dht", "cpu_averagers", "cpu_p2pd", "cpu_main"]),
              ("seconds", ["epoch_s", "boundary_s"]),
              ("group size", ["group_size_median"]),
              ("late joiners, seconds", ["joiner_download_s", "joiner_synced_s"])]
    labels = dict(FIGURES)
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    for ax, (title, keys) in zip(axes.flat, panels, strict=True):
        for key in keys:
            values = [value(row, key) for row in ok]
            b = found.get(key, {}).get("b")
            ax.plot(ns, values, "o-", label=labels[key] + (f" (b={b:.2f})" if b is not None else ""))
        if keys == ["group_size_median"]:
            ax.plot(ns, ns, "--", color="grey", label="N (the whole swarm)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("N peers")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    m = results["machine"]
    fig.suptitle(f"B7 scale — collabopt {m['collabopt']}, hivemind {m['hivemind']}, {m['date_utc']}, "
                 f"{m['cpus']} CPUs" + (" (smoke run)" if results["config"].get("smoke") else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write(results: dict[str, Any], out: Path) -> list[Path]:
    """scale.json, scale.md (keeping its hand-written part below :data:`NOTES`) and scale.png into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "scale.json", out / "scale.md"]
    paths[0].write_text(json.dumps(results, indent=1))
    old = paths[1].read_text() if paths[1].exists() else ""
    notes = old[old.index(NOTES):] if NOTES in old else NOTES + "\n"
    paths[1].write_text(markdown(results) + "\n" + notes)
    if plot(results, out / "scale.png"):
        paths.append(out / "scale.png")
    return paths
