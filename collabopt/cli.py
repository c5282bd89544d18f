"""The collabopt command: try a local swarm, start a bootstrap peer, check a machine, watch a run.

  collabopt demo                          train a small model with 3 local peer processes (about a minute)
  collabopt dht                           start a bootstrap peer and print the INITIAL_PEERS value to share
  collabopt doctor --initial-peers ADDR   check that this machine can join the swarm at ADDR
  collabopt monitor --run-id RUN          show the live state of a run
  collabopt keygen                        print a new swarm key (members only: every peer passes the same)

Run `collabopt COMMAND --help` for a command's options. Exit status: 0 done (or help), 1 a runtime error (one
line; --log-level DEBUG adds its traceback), 2 a usage error (a bad option or value), 130 interrupted (Ctrl+C).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from collabopt.errors import CollaborativeError, ConfigurationError
from collabopt.version import __version__

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default at the end of its help, unless its help states the default itself or there is none
    to state (a flag, or None: the help says what an absent option means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or "default" in text or action.default is None
                or action.default is argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


class _TopHelpFormatter(_HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The top-level help keeps the module docstring's layout (its table of commands)."""


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=None, metavar="LEVEL",
                        help=f"log level of collabopt and hivemind, one of {', '.join(LOG_LEVELS)} "
                             "(default: $HIVEMIND_LOGLEVEL, else INFO); DEBUG also shows an error's traceback")


# The network switches of each command, from collabopt.network_args (the examples take all of them, with the same
# help, defaults and environment variables): a bootstrap peer is found again at a fixed port and identity; the doctor
# checks the addresses a peer would start with; the monitor, a read-only client, only listens.
DHT_SWITCHES = ("initial_peers", "port", "host_maddrs", "announce_maddrs", "identity_path")
DOCTOR_SWITCHES = ("initial_peers", "port", "host_maddrs", "announce_maddrs", "client_mode")
MONITOR_SWITCHES = ("initial_peers", "host_maddrs")


def _swarm_args(switches: Sequence[str], peer: bool) -> argparse.ArgumentParser:
    """The network ``switches`` (collabopt.network_args), then the options of the commands only; ``peer=False``
    (the monitor, a read-only client) leaves out --use-auto-relay, which only a peer that others reach uses."""
    from collabopt.network_args import add_network_arguments

    parent = add_network_arguments(argparse.ArgumentParser(add_help=False), switches)
    parent.add_argument("--no-relay", dest="use_relay", action="store_false", help="disable libp2p circuit relay")
    if peer:
        parent.add_argument("--use-auto-relay", action="store_true",
                            help="let libp2p look for relays by itself (behind NAT, client mode or relay peers is what "
                                 "works: docs/joining.md)")
    parent.add_argument("--swarm-key-file", default=None, metavar="PATH",
                        help="the swarm's key (from collabopt keygen): members only (default: $COLLABOPT_SWARM_KEY, "
                             "else an open swarm)")
    return parent


def _ipfs_args() -> argparse.ArgumentParser:
    """The bootstrap peer's own option."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--use-ipfs", action="store_true", help="find initial peers through IPFS")
    return parent


def _swarm_key(args: argparse.Namespace):
    """The key of --swarm-key-file, else of $COLLABOPT_SWARM_KEY; None: an open swarm."""
    from collabopt.membership import read_swarm_key_file, swarm_key_from

    return read_swarm_key_file(args.swarm_key_file) if args.swarm_key_file else swarm_key_from(None)


def _swarm_options(args: argparse.Namespace):
    from collabopt.network_args import network_options
    from collabopt.swarm import SwarmOptions

    options = SwarmOptions(**network_options(args), use_ipfs=getattr(args, "use_ipfs", False), use_relay=args.use_relay,
                           use_auto_relay=getattr(args, "use_auto_relay", False), swarm_key=_swarm_key(args))
    options.validate()
    return options


def run_dht(args: argparse.Namespace) -> int:
    """A standalone bootstrap peer: prints the INITIAL_PEERS value and serves until Ctrl+C (exit 130) or SIGTERM
    (exit 0: how a service manager stops it)."""
    from collabopt.lifecycle import SigtermHandler, preserved_sigint
    from collabopt.swarm import membership_line, start_dht

    options = _swarm_options(args)
    with preserved_sigint():
        dht = start_dht(options)
    sigterm = SigtermHandler()
    sigterm.install()
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        value = ",".join(maddrs)
        print(f"INITIAL_PEERS={value}", flush=True)
        print(f"collabopt dht: serving until Ctrl+C. Start peers with\n"
              f"    INITIAL_PEERS={value} python your_script.py\n"
              f"  and check another machine with\n    collabopt doctor --initial-peers {value}\n"
              f"  {membership_line(options.swarm_key is not None)}", file=sys.stderr, flush=True)
        if args.peers_file:
            with open(args.peers_file + ".tmp", "w") as f:
                f.write(value)
            os.replace(args.peers_file + ".tmp", args.peers_file)
        while dht.is_alive():
            time.sleep(0.5)
        raise CollaborativeError("the DHT process stopped (the lines above may say why)")
    except SystemExit as e:
        return 0 if e.code in (None, 0, 128 + signal.SIGTERM) else int(e.code)
    finally:
        dht.shutdown()
        sigterm.restore()


def run_doctor(args: argparse.Namespace) -> int:
    """Check this machine against the initial peers; exit status 1 when a check fails."""
    from collabopt.doctor import DoctorOptions, format_report, report_json, run_checks
    from collabopt.network_args import network_options
    from collabopt.swarm import DEFAULT_HOST_MADDRS

    given = network_options(args, check_addresses=False)  # (a bad address is a failed check of the report)
    options = DoctorOptions(initial_peers=given.get("initial_peers", []),
                            host_maddrs=given.get("host_maddrs", list(DEFAULT_HOST_MADDRS)),
                            announce_maddrs=given.get("announce_maddrs"), client_mode=given.get("client_mode", False),
                            use_relay=args.use_relay, use_auto_relay=args.use_auto_relay, timeout=args.timeout,
                            swarm_key=_swarm_key(args))
    if not args.json:
        print("collabopt doctor: checking this machine" + (" against its initial peers (a few seconds)"
                                                           if options.initial_peers else ""), flush=True)
    checks = run_checks(options)
    print(report_json(checks) if args.json else format_report(checks), flush=True)
    return 1 if any(check.failed for check in checks) else 0


def run_monitor(args: argparse.Namespace) -> int:
    """Print the progress every peer of a run publishes to the DHT (signed progress records, in hivemind's format)."""
    from collabopt.lifecycle import preserved_sigint
    from collabopt.metrics import read_swarm_progress, reader_validators
    from collabopt.swarm import start_dht

    # a read-only client: never a training peer, and able to read the signed progress records
    options = dataclasses.replace(_swarm_options(args), client_mode=True, record_validators=reader_validators())
    if not options.initial_peers:
        raise ConfigurationError("--initial-peers", "none given: the monitor reads the run from a running swarm",
                                 "pass the address a peer (or `collabopt dht`) printed, or set INITIAL_PEERS")
    if args.serve:
        from collabopt.status_page import serve

        return serve(options, args.run_id, args.serve, args.interval, args.stall_after)
    with preserved_sigint():
        dht = start_dht(options)
    try:
        rounds = 0
        while args.count <= 0 or rounds < args.count:
            report = read_swarm_progress(dht, args.run_id)
            print(json.dumps(report) if args.json else report_text(report), flush=True)
            rounds += 1
            if args.count <= 0 or rounds < args.count:
                time.sleep(args.interval)
        return 0
    finally:
        dht.shutdown()


def run_keygen(_args: argparse.Namespace) -> int:
    """Print a new swarm key (256 random bits): give it, as a file or $COLLABOPT_SWARM_KEY, to members only."""
    from collabopt.membership import new_swarm_key

    print(new_swarm_key(), flush=True)
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from collabopt.demo import run_demo as demo

    return demo(args)


def report_text(report: dict) -> str:
    lines = [
        f"run {report['run_id']}: {report['num_peers']} peers, epoch {report['global_epoch']}, "
        f"{report['samples_accumulated']} samples this epoch, {report['samples_per_second']:.1f} samples/s"
    ]
    for peer in report["peers"]:
        lines.append(
            f"  {peer['peer_id'][:16]}  epoch {peer['epoch']}  samples {peer['samples_accumulated']}  "
            f"{peer['samples_per_second']:.1f}/s{'  (client)' if peer['client_mode'] else ''}"
            + (f"  last round {peer['last_round']}" if peer.get("last_round") else "")
        )
    if not report["peers"]:
        lines.append("  no peer of this run has published its progress yet (is --run-id the run_id the peers use?)")
    rejected = report.get("rejected") or {}
    if rejected:
        lines.append(f"  ignored {sum(rejected.values())} records under the run's keys: "
                     + ", ".join(f"{count} {reason}" for reason, count in sorted(rejected.items())))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="collabopt", description=__doc__, formatter_class=_TopHelpFormatter)
    parser.add_argument("--version", action="version", version=f"collabopt {__version__}")
    # the commands are listed once, in the description's table (a subparser given no help= is not listed again)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands",
                                help="one of the commands above")

    def command(name: str, description: str, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return sub.add_parser(name, description=description, parents=list(parents), formatter_class=_HelpFormatter)

    demo = command("demo", "Train a digits classifier with a local swarm: a bootstrap DHT and --peers peer processes "
                           "on this machine, a live progress bar, and a summary (global epochs, held-out accuracy, "
                           "the largest parameter difference between peers). Exit status 1 when a peer fails, the "
                           "peers diverge or the demo times out.")
    demo.add_argument("--peers", type=int, default=3, help="number of training peers")
    demo.add_argument("--epochs", type=int, default=12, help="global epochs to train")
    demo.add_argument("--target-batch-size", type=int, default=1024, help="samples per global epoch")
    demo.add_argument("--run-id", default=None, help="run id (default: a fresh random one)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--timeout", type=float, default=110.0,
                      help="seconds each peer trains at most; the demo gives up 30 s after")
    demo.add_argument("--serve", metavar="HOST:PORT", default=None,
                      help="also serve the run's status page there, as collabopt monitor --serve does")

    dht = command("dht", "Run a bootstrap peer (a DHT node that trains nothing) until Ctrl+C, and print the "
                         "INITIAL_PEERS value that training peers and collabopt doctor/monitor take.",
                  _swarm_args(DHT_SWITCHES, peer=True), _ipfs_args())
    dht.add_argument("--peers-file", default=None, help="also write the INITIAL_PEERS value to this file")

    doctor = command("doctor", "Check that this machine can join the swarm of --initial-peers: versions, addresses, "
                               "each initial peer (connection, DHT ping, clock) and whether other machines can "
                               "connect to this one (if not: client_mode=True or relay_peers=[...]). Pass the "
                               "network switches the peer will start with (--client-mode: then accepting no "
                               "connections is fine). Exit status 1 when a check fails.",
                     _swarm_args(DOCTOR_SWITCHES, peer=True))
    doctor.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each peer")
    doctor.add_argument("--json", action="store_true", help="the checks as one JSON object")

    monitor = command("monitor", "Show the live state of a run, read from the progress records its peers publish "
                                 "to the DHT: joins as a read-only client (trains nothing, accepts no connections).",
                      _swarm_args(MONITOR_SWITCHES, peer=False))
    monitor.add_argument("--run-id", required=True, help="the run_id the peers train with (in their join message)")
    monitor.add_argument("--interval", type=float, default=2.0, help="seconds between two reports")
    monitor.add_argument("--count", type=int, default=0, help="number of reports; 0: until Ctrl+C")
    monitor.add_argument("--json", action="store_true", help="one JSON object per report")
    monitor.add_argument("--serve", metavar="HOST:PORT", default=None,
                         help="serve a status page (/), its state (/api/state) and Prometheus metrics (/metrics)")
    monitor.add_argument("--stall-after", type=float, default=60.0,
                         help="with --serve: seconds without progress before the run counts as stalled")

    command("keygen", "Print a new random swarm key (256 bits, text). Every member passes the same key: "
                      "swarm_key=..., $COLLABOPT_SWARM_KEY, or --swarm-key-file for collabopt dht/monitor/doctor "
                      "(collabopt keygen > swarm.key). Peers without it cannot join, read or count.")
    for each in sub.choices.values():  # last in each command's help: the same in every command
        _add_log_level(each)
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": run_demo, "dht": run_dht, "doctor": run_doctor, "monitor": run_monitor, "keygen": run_keygen}


def set_log_level(level: str | None) -> None:
    """``--log-level``: the level of hivemind's and collabopt's loggers here, and (through $HIVEMIND_LOGLEVEL) of
    the processes this command starts. None keeps hivemind's own choice ($HIVEMIND_LOGLEVEL, else INFO)."""
    if level is None:
        return
    import logging

    import hivemind.utils.logging as hivemind_logging

    os.environ["HIVEMIND_LOGLEVEL"] = level
    hivemind_logging.get_logger("hivemind").setLevel(level)
    logging.getLogger("collabopt").setLevel(level)


def _one_line(error: BaseException) -> str:
    """An error as one line: collabopt's own say what to do; any other is named by its type."""
    text = " ".join(str(error).split())
    if isinstance(error, CollaborativeError):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit status (it never raises SystemExit): 0 done or help, 1 a runtime error
    (printed as one line; with --log-level DEBUG after its traceback), 2 a usage error (argparse's, or a
    :class:`ConfigurationError`: a bad option value), 130 Ctrl+C. The same in every command, so that scripts and
    service managers can tell them apart."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # a bare `collabopt`: what it can do, not an error
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version (0) or a usage error (2): argparse printed what to say
        return e.code if isinstance(e.code, int) else 2
    set_log_level(args.log_level)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:  # Ctrl+C: what the command started has been stopped on the way out
        print(f"\ncollabopt {args.command}: interrupted", file=sys.stderr)
        return 130
    except ConfigurationError as e:
        print(f"collabopt {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        level = args.log_level or os.environ.get("HIVEMIND_LOGLEVEL", "INFO")
        if level.upper() == "DEBUG":
            import traceback

            traceback.print_exc()
        hint = "" if isinstance(e, CollaborativeError) else " (--log-level DEBUG shows the traceback)"
        print(f"collabopt {args.command}: {_one_line(e)}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
