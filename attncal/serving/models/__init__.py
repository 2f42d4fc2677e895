"""Model templates copied into generated Triton repositories as `model.py` (never imported by attncal)."""
