"""Tooling for collabopt's tests, demo and benchmarks, not used by training: starting and stopping peer processes
(:mod:`.processes`) and network namespaces for fault tests (:mod:`.testnet`)."""
