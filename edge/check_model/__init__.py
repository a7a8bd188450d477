"""`edge check-model` and its size tables."""
