"""The native CPU kernels: their build, the torch operators, linear layers, attention, the decode step, quantization."""
