"""The harness of the tests and the benchmarks, outside the installed package: the launcher that forks their peer
processes (:mod:`.launcher`) and the network namespaces of the fault tests and the WAN benchmarks (:mod:`.testnet`).
The processes themselves are :mod:`collabopt.processes` (``collabopt demo`` uses it too)."""
