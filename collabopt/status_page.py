"""``collabopt monitor --serve HOST:PORT``: a run's status page, its state as JSON and as Prometheus metrics.

Served from this process by the standard library's HTTP server; everything the page needs ships with the package
(``collabopt/static``: one HTML file, one script drawing its plots as SVG, one style sheet), so it works offline:

* ``/``: the page: verdict, global epoch and ETA, swarm samples/s, one row per peer, plots of throughput, loss and
  peers over time; it reads ``/api/state`` every refresh interval;
* ``/api/state``: :meth:`collabopt.monitor.SwarmMonitor.state` as JSON;
* ``/metrics``: the same numbers in Prometheus' text format (``prometheus_client``).

Example (a monitor of a running swarm; then open http://127.0.0.1:8080/)::

    collabopt monitor --serve 127.0.0.1:8080 --run-id my_run --initial-peers /ip4/10.0.0.2/tcp/31337/p2p/Qm...
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from collabopt.errors import ConfigurationError
from collabopt.monitor import SwarmMonitor

__all__ = ["StatusServer", "parse_address", "prometheus_text", "serve"]

_STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def parse_address(value: str, parameter: str = "--serve") -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6; port 0: any free port) as ``(host, port)``.

    >>> parse_address("127.0.0.1:8080")
    ('127.0.0.1', 8080)
    """
    fix = "pass HOST:PORT, e.g. 127.0.0.1:8080 (0.0.0.0:8080 to serve other machines too)"
    host, sep, port = str(value).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigurationError(parameter, f"{value!r} is not HOST:PORT", fix)
    return host, int(port)


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def prometheus_text(state: dict[str, Any]) -> tuple[bytes, str]:
    """The state in Prometheus' text exposition format, and its content type."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class StateCollector:
        def collect(self):
            run = [state["run_id"]]

            def gauge(name: str, doc: str, value: Any):
                family = GaugeMetricFamily(f"collabopt_{name}", doc, labels=["run_id"])
                family.add_metric(run, float("nan") if value is None else float(value))
                return family

            yield gauge("global_epoch", "Global epoch of the swarm (the newest epoch of a live peer)",
                        state["global_epoch"])
            yield gauge("samples_per_second", "Samples per second of the whole swarm (live peers)",
                        state["samples_per_second"])
            yield gauge("samples_accumulated", "Samples accumulated toward the next global epoch",
                        state["samples_accumulated"])
            yield gauge("target_batch_size", "Samples per global epoch", state["target_batch_size"])
            yield gauge("eta_seconds", "Estimated seconds to the next global epoch", state["eta_seconds"])
            yield gauge("loss", "Mean training loss reported by the live peers", state["loss"])
            yield gauge("peers", "Live training peers", state["num_peers"])
            yield gauge("peers_known", "Peers seen, live or not", state["peers_known"])
            verdict = GaugeMetricFamily("collabopt_verdict", "1 for the swarm's current verdict",
                                        labels=["run_id", "verdict"])
            for name in ("training", "stalled", "diverging"):
                verdict.add_metric(run + [name], float(state["verdict"] == name))
            yield verdict
            rejected = CounterMetricFamily("collabopt_rejected_records",
                                           "Records under the run's keys refused by the monitor (distinct records)",
                                           labels=["run_id", "record", "reason"])
            for kind_reason, count in state["rejected"]["by_kind"].items():
                kind, reason = kind_reason.split("/", 1)
                rejected.add_metric(run + [kind, reason], count)
            yield rejected
            labels = ["run_id", "peer"]
            families = {
                "epoch": GaugeMetricFamily("collabopt_peer_epoch", "Epoch of a peer", labels=labels),
                "samples_per_second": GaugeMetricFamily("collabopt_peer_samples_per_second",
                                                        "Samples per second of a peer", labels=labels),
                "share": GaugeMetricFamily("collabopt_peer_share", "A peer's share of the samples contributed",
                                           labels=labels),
                "last_seen": GaugeMetricFamily("collabopt_peer_last_seen_seconds",
                                               "Seconds since a peer's newest record", labels=labels),
                "loss": GaugeMetricFamily("collabopt_peer_loss", "Training loss a peer reported", labels=labels),
            }
            status = GaugeMetricFamily("collabopt_peer_status", "1 for a peer's state", labels=labels + ["status"])
            for peer in state["peers"]:
                for name, family in families.items():
                    value = peer.get(name)
                    family.add_metric(run + [peer["id"]], float("nan") if value is None else float(value))
                for name in ("in sync", "catching up", "stale", "left"):
                    status.add_metric(run + [peer["id"], name.replace(" ", "_")], float(peer["sync"] == name))
            yield from families.values()
            yield status

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector())
    from prometheus_client import CONTENT_TYPE_LATEST

    return generate_latest(registry), CONTENT_TYPE_LATEST


def _static(name: str) -> tuple[bytes, str] | None:
    """A file of ``collabopt/static`` (names of files there only: no path)."""
    if "/" in name or "\\" in name or name.startswith("."):
        return None
    suffix = name[name.rfind("."):] if "." in name else ""
    if suffix not in _STATIC_TYPES:
        return None
    path = resources.files("collabopt") / "static" / name
    if not path.is_file():
        return None
    return path.read_bytes(), _STATIC_TYPES[suffix]


class StatusServer:
    """Serves a :class:`~collabopt.monitor.SwarmMonitor`'s state over HTTP from daemon threads.

    ``StatusServer(monitor, ("127.0.0.1", 0)).start()`` starts the monitor's reads and the server; ``url`` is where
    it listens (the port chosen when 0 was asked); ``stop()`` ends both.
    """

    def __init__(self, monitor: SwarmMonitor, address: tuple[str, int]):
        self.monitor = monitor
        self.httpd = ThreadingHTTPServer(address, self._handler())
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="collabopt-status-page", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/"

    def start(self) -> StatusServer:
        self.monitor.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.monitor.stop()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        monitor = self.monitor

        class Handler(BaseHTTPRequestHandler):
            server_version = "collabopt-monitor"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/api/state":
                    body = json.dumps(_finite(monitor.state()), allow_nan=False).encode()
                    self._send(body, "application/json")
                elif path == "/metrics":
                    self._send(*prometheus_text(monitor.state()))
                else:
                    found = _static("index.html" if path in ("/", "/index.html") else path.rpartition("/")[2]
                                    if path.startswith("/static/") else "")
                    if found is None:
                        self.send_error(HTTPStatus.NOT_FOUND)
                    else:
                        self._send(*found)

            def _send(self, body: bytes, content_type: str) -> None:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                pass  # quiet: the page polls every few seconds

        return Handler


def serve(options: Any, run_id: str, address: str, interval: float = 2.0, stall_after: float = 60.0) -> int:
    """``collabopt monitor --serve``: join the swarm as a read-only client (``options``: a
    :class:`~collabopt.swarm.SwarmOptions` with ``client_mode=True``) and serve the run's status page until Ctrl+C or
    SIGTERM."""
    from collabopt.lifecycle import SigtermHandler, preserved_sigint
    from collabopt.swarm import start_dht

    host, port = parse_address(address)
    for name, value in (("--interval", interval), ("--stall-after", stall_after)):
        if not value > 0:
            raise ConfigurationError(name, f"must be a positive number of seconds, got {value}", "e.g. 2")
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigurationError("--serve", "needs prometheus_client", "pip install prometheus_client") from None
    with preserved_sigint():
        dht = start_dht(options)
    sigterm = SigtermHandler()
    sigterm.install()
    server = None
    try:
        try:
            server = StatusServer(SwarmMonitor(dht, run_id, interval=interval, stall_after=stall_after), (host, port))
        except OSError as e:
            raise ConfigurationError("--serve", f"cannot listen on {address} ({e})", "choose another port") from None
        server.start()
        print(f"collabopt monitor: run {run_id!r} at {server.url} (JSON: {server.url}api/state, Prometheus: "
              f"{server.url}metrics)", flush=True)
        while dht.is_alive():
            time.sleep(0.5)
        print("collabopt monitor: the DHT client stopped", file=sys.stderr)
        return 1
    except SystemExit as e:  # SIGTERM: a service manager's stop (Ctrl+C propagates: collabopt's exit status 130)
        return 0 if e.code in (None, 0, 143) else int(e.code)
    finally:
        if server is not None:
            server.stop()
        dht.shutdown()
        sigterm.restore()
