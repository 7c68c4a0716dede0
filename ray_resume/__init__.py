"""Exact mid-epoch resume inside Ray Train: ``RayResume`` in ``train_loop_per_worker``.

def train_func(config):
    # shards across workers
    loader = ResumableDataLoader(dataset, batch_size=32, shuffle=True, seed=0)
    model = ray.train.torch.prepare_model(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    resume = RayResume(loader, model=model, optimizer=optimizer, every_n_steps=50)
    for epoch in resume.epochs(config["epochs"]):   # restores Ray's checkpoint first
        for x, y in loader:
            x, y = to_device((x, y))
            ...                                      # forward, backward, optimizer.step()
            resume.step_end({"loss": loss.item()})   # a checkpoint reported to Ray when due
"""

from .files import RANK_FILE
from .resume import RayResume, to_device

__all__ = ["RANK_FILE", "RayResume", "to_device"]
