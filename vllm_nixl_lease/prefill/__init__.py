"""The lease core on P (the prefill worker): the lease table, the router that
applies one step's notifications to it, and how an expiry sweep is logged.
Imports nothing from vLLM."""
