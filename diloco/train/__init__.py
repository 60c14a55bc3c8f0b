"""Inner training: optimizer, pure train/eval steps, device meshes and the data-parallel trainer."""
