"""The decode model: GGUF conversion and loading, family settings, fused projections, weight quantization."""
