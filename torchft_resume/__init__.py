"""Exactly-once data under TorchFT's live recovery: ``TorchFTResume`` in each replica group.

    resume = TorchFTResume(manager, loader)  # Manager(use_async_quorum=False)
    for batch in resume.batches(epochs=2):
        loss = model(batch).sum()
        loss.backward()
        resume.average_gradients(model.parameters())  # through manager.allreduce
        if resume.commit():  # False: the batch is given back
            optimizer.step()
        optimizer.zero_grad()
"""

from .resume import STATE_KEY, TorchFTResume

__all__ = ["STATE_KEY", "TorchFTResume"]
