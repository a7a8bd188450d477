"""The dense decoder and dense KV cache: the oracle that tests and check-model compare the engine with."""
