"""`attncal bench`: calibrated vs uncalibrated engines, measured side by side in one run."""
