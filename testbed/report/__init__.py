"""Run directory files, plots and W&B logging."""
