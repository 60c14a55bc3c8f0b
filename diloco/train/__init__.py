"""Inner training: optimizer, pure train/eval steps, device meshes, the data-parallel trainer, and
what a run costs (model FLOPs and MFU, a device's memory estimate, a profiler trace)."""
