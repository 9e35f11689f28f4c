"""`make chaos`: a seeded nemesis over a multi-host fleet, a history of what
happened and a checker over it (issue 24).

One concept per module: ``history`` (the JSON-lines record), ``schedule``
(the seeded fault plan), ``faults`` (how each kind is applied and undone),
``nft`` and ``starve`` (the mechanisms), ``nemesis`` (runs the plan),
``nodes`` (engine handles that survive kills and restarts), ``workload``
(requests, waits and bursts), ``checker`` (the rules), ``timeline`` (the
figure), ``report`` (check, summary and figure at the end of a run),
``harness_lane`` (the NIXL fleet run end to end); the `vllm serve` lane:
``serve_nodes`` (servers and router on namespace hosts), ``serve_workload``
(routed requests judged against P alone), ``serve_checker`` (its rules) and
``serve_lane`` (the run end to end).
"""
