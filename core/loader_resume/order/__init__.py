"""The order of samples of a map-style dataset: global positions, each epoch's plan of steps, the
keyed permutation, samplers and their sharding, mixtures of datasets, batches handed over out of
order.
"""
