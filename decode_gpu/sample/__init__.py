"""Next-token choice for a batch: the sampler, per-row parameters, seeded noise, grammar masks."""
