"""child processes: the supervisor, the child entry, Ray placement."""
