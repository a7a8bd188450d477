"""observers: gauges, audit, tracing, the status board."""
