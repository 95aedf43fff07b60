"""Training: the Python API (DiLoCo, sync DP), the CLI's trainer, model, data, export."""
