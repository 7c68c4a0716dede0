"""Iterable datasets: each worker's stream, its progress carried with every batch, the state it
makes, and the protocols of libraries that keep their own position (litdata, Mosaic Streaming).
"""
