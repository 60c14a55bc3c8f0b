"""Runtimes deliver events to the pure learner and syncer state machines (docs/design.md#runtimes).

This package holds the core they share (typed learner events, one SyncerHost, one wall-clock
learner loop, learner units, rejoin, checkpoints, run logs, stops) and the four runtimes: sim/
(virtual clock, one process), threads/ (wall clock, a thread per learner), procs/ (a process per
learner and the syncer over an object store) and ray_runtime.py (procs' supervisor and processes
with a launcher that starts them as Ray actors); world.py lets a learner span several hosts.
"""
