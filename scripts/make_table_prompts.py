"""Build service/prompts/tables.jsonl: Python literal tables whose rows repeat one record.

Provenance: written for this repository (no outside text). Each prompt opens a dict literal
`ROWS_i = {` and lists six rows `n: <record>,` for n = 0..5, where the record is one of eight
everyday Python/configuration literals (an HTTP route tuple, an SQLAlchemy column, a logging
handler spec...). The continuation the text asks for is row 6, 7, ... of the same record: a key
that counts, then a long span the prompt already holds. Prompt lookup (the n-gram drafter) copies
that span; the small draft model, trained on CPython sources where such tables are rare, agrees
with the target much less than on ordinary code (measured greedy acceptance at k=8: n-gram 0.58,
model drafter at T=0 0.33; on the held-out code prompts 0.26 and 0.83). The workload-shift
benchmark's second workload. Deterministic: rerun to reproduce the committed file byte for byte.

    python scripts/make_table_prompts.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "service" / "prompts" / "tables.jsonl"
ROWS = 6
RECORDS = (
    "('GET', '/api/v1/items', 'application/json', 200, True),",
    "Column('name', String(64), nullable=False, index=True),",
    "{'method': 'POST', 'path': '/login', 'status': 302},",
    "Field(type='int', default=0, required=True, doc='counter'),",
    "Route('/static', StaticFiles(directory='static'), name='static'),",
    "('error', logging.ERROR, sys.stderr, '%(asctime)s %(message)s'),",
    "Option('--verbose', action='store_true', default=False),",
    "('utf-8', 'strict', b'\\xef\\xbb\\xbf', len(b'\\xef\\xbb\\xbf')),",
)


def table_prompt(index: int, record: str) -> str:
    return f"ROWS_{index} = {{\n" + "".join(f"    {n}: {record}\n" for n in range(ROWS))


def main() -> None:
    with TARGET.open("w") as f:
        for i, record in enumerate(RECORDS):
            f.write(json.dumps({"id": i, "source": f"written for moespec: record {i}, {ROWS} rows",
                                "prompt": table_prompt(i, record)}) + "\n")


if __name__ == "__main__":
    main()
