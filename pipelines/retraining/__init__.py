"""Scheduled retraining: checkpoint sources and the watcher that submits one job per new target."""
