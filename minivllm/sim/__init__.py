"""Simulation (notebooks 09 and 14): the simulated model runner and its cost model, the
cluster simulator, and the workloads every benchmark and simulation replays.
"""
