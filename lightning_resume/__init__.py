"""Lightning integration of loader-resume (the ResumeCallback lands with its own issue)."""
