"""How bytes move between a host pool and an engine's KV buffers: one file per io path.

mover.py is the interface every path implements (a mover builds a launch, which the
transfer's plan keeps and runs); copier.py what copies bytes (each vendor runtime and
memmove implement it); streams.py orders their work; context.py what a pool's paths
share; kernel.py, bulk.py, direct.py, staged.py (with staging_schedule.py and
staging.py) and auto.py are the paths.
"""
