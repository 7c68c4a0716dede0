"""Keyed randomness: every random number a batch draws is a function of (seed, epoch, position), in
the main process and in the workers, whatever ran before.
"""
