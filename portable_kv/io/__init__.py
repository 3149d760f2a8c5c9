"""How bytes move between a host pool and an engine's KV buffers: one file per io path.

mover.py is the interface every path implements; engine.py the copy engine they
drive (each vendor runtime and the host implement it); streams.py orders their
work; kernel.py, direct.py, staged.py (with staged_plan.py and staging.py) and
auto.py are the paths.
"""
