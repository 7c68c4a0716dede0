"""What the tests share: datasets and builders (``data``), launchers of real processes (``launch``).

No test module imports another; they import from here."""
