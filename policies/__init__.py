"""Operator policies: request filters, client classes and load-based degradation. Pure Python."""
