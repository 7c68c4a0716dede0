"""Accelerate integration of loader-resume (enable_resume lands with its own issue)."""
