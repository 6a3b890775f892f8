"""Entry points for `python -m jobs.<name> --config FILE key=value ...` (locally or via
`ray job submit`); each is a thin script over `pipelines/`, sharing `jobs.cli`."""
