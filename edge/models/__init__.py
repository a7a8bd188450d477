"""Several models on one appliance (issue 45): the configured models, each a whole single-model stack, loaded on
demand within the memory budget and unloaded when idle or evicted."""
