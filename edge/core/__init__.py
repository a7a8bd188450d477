"""the request's life in the gateway: admission, prefill pool, engines, SLO control, metrics."""
