"""`make chaos`: a seeded nemesis over a multi-host fleet, a history of what
happened and a checker over it (issue 24).

One concept per module: ``history`` (the JSON-lines record), ``schedule``
(the seeded fault plan), ``faults`` (how each kind is applied and undone),
``nft`` and ``starve`` (the mechanisms), ``nemesis`` (runs the plan),
``nodes`` (engine handles that survive kills and restarts), ``workload``
(requests, waits and bursts), ``checker`` (the rules), ``timeline`` (the
figure), ``harness_lane`` (the NIXL fleet run end to end).
"""
