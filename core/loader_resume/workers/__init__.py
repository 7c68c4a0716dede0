"""DataLoader workers: their start (a worker that never starts is named), what travels to them, and
the few torch internals the package relies on, kept in one place.
"""
