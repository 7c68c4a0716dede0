"""The tools around the library: ``loader-resume`` (``cli``), its pipeline check (``check``) and the
demo training loop (``demo``)."""
