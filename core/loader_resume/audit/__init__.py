"""The audit of a real run: each rank's log of what its loaders handed over (``log``), read back
(``read``) and checked (``check``: ``report``, ``map``, ``stream``) by ``loader-resume audit``.
"""
