"""From a checkpoint's files to placed tensors: the index, shard reading, layout, offload folder, residency."""
