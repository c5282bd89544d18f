"""collabopt's engine: the training protocol, composed from hivemind's parts (see ``docs/development.md`` for the map:
which module holds which step of a round).

Layers, each importing only those below it:

* ``compat``, ``dialback``: supported hivemind versions and small facts; the dial-back protocol ``doctor`` uses;
* ``p2p``, ``records``, ``progress``, ``averaging``, ``state``: services (DHT and libp2p, the run's records, the
  swarm's progress, collabopt's averagers, serving and downloading state);
* ``lineage_check``, ``sync_download``, ``sync_round``: the synchronous mode's round;
* ``diloco_averaging``, ``diloco_round``: DiLoCo mode's round;
* ``peer``: this process's peer, the surface the core uses.
"""
