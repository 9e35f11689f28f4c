"""`make chaos`: a seeded nemesis over a multi-host fleet, a history of what
happened and a checker over it: randomized faults find the interleavings that
no hand-written scenario thinks of, and the seed replays them.

One concept per module: ``history`` (the JSON-lines record), ``schedule``
(the seeded fault plan), ``nft`` and ``starve`` (the mechanisms),
``nemesis`` (runs the plan: how each kind is applied and undone),
``nodes`` (engine handles that survive kills and restarts), ``workload``
(requests, waits and bursts), ``progress`` (what the run has done so far),
``checker`` (the rules, ``check_recovery`` the one rule both lanes share), ``timeline`` (the
figure), ``report`` (check, summary and figure at the end of a run),
``harness_lane`` (the NIXL fleet run end to end); the `vllm serve` lane:
``serve_nodes`` (servers and router on namespace hosts), ``serve_workload``
(routed requests judged against P alone), ``serve_checker`` (its rules) and
``serve_lane`` (the run end to end).
"""
