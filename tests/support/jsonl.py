"""Reading a run's JSONL records back."""
import json


def read_jsonl(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]
