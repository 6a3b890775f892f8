"""What every kind of pipeline code shares: MLflow tracking, plots, Ray start-up, remote targets."""
