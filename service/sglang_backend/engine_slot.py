"""One sglang.Engine at a time: start, swap when the policy needs other start-up arguments, stop;
stream a request; read what the expert-distribution recorder saw since the last read.

Not thread-safe by design: Engine's blocking API drives one asyncio loop with run_until_complete,
which two threads cannot share, so the backend calls this under its lock.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from service.private_files import make_private, private_dir, write_private_text
from service.sglang_backend.records import ForwardPass, dump_files, load_dump

log = logging.getLogger(__name__)

# SGLang reads the dump directory from this variable in its scheduler subprocess
# (envs.SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, default /tmp); the subprocess inherits our
# environment when the Engine starts it, so it is set just before each start.
RECORDER_DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"


class EngineSlot:
    def __init__(self, sglang: ModuleType, base_kwargs: dict, record_dir: Path | None, keep_records: bool = False):
        self._sglang = sglang
        self._base = dict(base_kwargs)
        self._record_dir = record_dir  # None: the recorder is off
        self._keep = keep_records  # archive what was read instead of deleting it
        self._archived = 0
        self._engine = None
        self._key: tuple | None = None
        self._passes_read = 0  # numbering continues across dumps so pass indices stay unique

    @property
    def recording(self) -> bool:
        return self._record_dir is not None

    def running(self, spec_kwargs: dict) -> bool:
        return self._engine is not None and self._key == _key(spec_kwargs)

    def start(self, spec_kwargs: dict) -> None:
        """Stop the current engine (if any) and start one with these speculative arguments."""
        self.stop()
        kwargs = {**self._base, **spec_kwargs}
        if self._record_dir is not None:
            private_dir(self._record_dir)  # 0700, and never a folder others may plant dump files in
            os.environ[RECORDER_DIR_ENV] = str(self._record_dir)
        log.info("starting sglang.Engine(%s)", ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items())))
        t0 = time.perf_counter()
        self._engine = self._sglang.Engine(**kwargs)
        self._key = _key(spec_kwargs)
        if self._record_dir is not None:
            # Recording stays on for the engine's life; every dump_record() empties it.
            self._engine.start_expert_distribution_record()
        log.info("sglang engine up in %.1f s", time.perf_counter() - t0)

    def stop(self) -> None:
        if self._engine is not None:
            engine, self._engine, self._key = self._engine, None, None
            engine.shutdown()

    def stream(self, input_ids: list[int], sampling_params: dict, rid: str) -> Iterator[dict]:
        """Chunks with the cumulative output_ids (and text) so far; the last one is finished."""
        return self._engine.generate(input_ids=input_ids, sampling_params=sampling_params, stream=True, rid=rid)

    def abort(self, rid: str) -> None:
        # Engine has no abort method; its tokenizer manager's is what /abort_request calls.
        self._engine.tokenizer_manager.abort_request(rid=rid)

    def take_passes(self, evidence: dict | None = None) -> list[ForwardPass]:
        """Every pass recorded since the last call, in run order (files read, then deleted or, with
        keep_records, moved to `read/NNNNN/` beside `evidence` as request.json)."""
        if self._record_dir is None or self._engine is None:
            return []
        self._engine.dump_expert_distribution_record()  # blocks until the scheduler has written
        passes: list[ForwardPass] = []
        for path in dump_files(self._record_dir, rank=0):
            passes.extend(load_dump(path, start_index=self._passes_read + len(passes)))
        dumps = sorted(self._record_dir.glob("expert_distribution_recorder_*.pt"))
        if self._keep:
            archive_read(self._record_dir, self._archived, evidence or {}, dumps)
            self._archived += 1
        else:
            for path in dumps:
                path.unlink(missing_ok=True)
        # The rank in the name is the MoE EP rank, so under TP without EP every TP rank writes a
        # `_0` copy of the same passes. Reading them all is harmless: attribution follows each
        # request's chain of positions, and a repeated pass no longer matches where it continues.
        self._passes_read += len(passes)
        return passes


def archive_read(record_dir: Path, number: int, evidence: dict, dumps: list[Path]) -> Path:
    """Move read dumps to `read/NNNNN/` beside request.json; folders 0700, files 0600 (they hold the
    requests' token ids), nothing written through a symlink."""
    archive = private_dir(record_dir / "read") / f"{number:05d}"
    archive.mkdir(mode=0o700)
    write_private_text(archive / "request.json", json.dumps(evidence))
    for path in dumps:
        make_private(path)
        path.rename(archive / path.name)
    return archive


def _key(spec_kwargs: dict) -> tuple:
    return tuple(sorted(spec_kwargs.items()))
