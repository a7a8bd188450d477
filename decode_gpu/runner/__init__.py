"""The model runner, the only owner of device state: step inputs, CUDA graphs, KV sizing, the device choice."""
