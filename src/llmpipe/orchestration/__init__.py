"""Helpers of the Prefect flow `full-pipeline` (flows/full_pipeline.py) that need no Prefect: stage
processes, the stage plan read from DVC, experiment working copies, and the run summary."""
