"""The one error of trajectory input: a record that cannot be used. Callers write it to
quarantine.jsonl with the record's index and where it came from; it never fails a job."""


class Quarantine(Exception):
    """A record that cannot be used: `reason` is a short code, `detail` says where/why."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail
