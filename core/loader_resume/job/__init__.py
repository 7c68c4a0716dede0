"""The job around the loader: checkpoints written whole (sealed, verified, on object storage too),
checkpoint directories and their locks and leases, remote copies, the preemption signal and the
agreed stop, SLURM and launchers, the generators of a training step.
"""
