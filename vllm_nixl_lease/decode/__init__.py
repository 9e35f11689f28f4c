"""The lease core on D (the decode instance): the heartbeat tracker (D's
scheduler), and D's views of P's leases with the acknowledgement ledger that
renews them (D's worker).  Imports nothing from vLLM."""
