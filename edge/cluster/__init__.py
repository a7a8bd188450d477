"""Running the prefill workers and decode engines on a Ray cluster (edge serve --ray). Imports Ray: only that path
loads this package."""
