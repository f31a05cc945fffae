"""Step recordings: every verify step of a run, with its routed top-k ids, in a compact file that
`moespec whatif` replays.

Format (JSON Lines, appendable, one complete line per step so a killed server leaves a readable file):
- a header line each time a recorder opens the file:
  {"format": "moespec.steps", "version": 1, "model": ..., "num_layers": L, "num_experts": E,
   "top_k": m, "shared_experts": ..., "hidden_size": H, "decode_step_seconds": ...}
- one line per step: {"r": request number (within this header), "drafter", "k", "temp", "policy",
  "drafted", "accepted", "committed", "flags": "1100" (per drafted position: 1 = before the first
  rejection), "w": window,
  "draft_s", "verify_s", "dse": decode-step equivalents, "tokens": [w] window token ids,
  "topk": base64 of the [L, w, m] routed ids as little-endian uint8 (uint16 when E > 256)}.
  About 0.5 kB per step for a 9-position window of a 4-layer top-8 model.
  A step of a tree policy adds "tw": its tree width and "parents": [drafted] each node's parent node
  (-1 = the window's first token; StepRecord.tree_parents); its "flags" then mark the nodes on the
  accepted path, and "tokens" / "topk" hold the window's first token, then the nodes in drafting order.
  Chain steps carry neither key, so their lines are what they were.
The file is created 0600 (an existing one is narrowed to 0600) and never opened through a symlink:
its token ids let anyone who reads it rebuild the requests' outputs.
A file may hold several headers (a server restarted on the same file); they must describe the same
model, and request numbers restart under each.
On load a chain step's per-position acceptance is derived from "accepted"
(service.types.accepted_positions), not read from "flags": files written before the flags meant the
accepted prefix replay the same. A tree step's is read from "flags" (checked to be a path from the root
of "accepted" nodes), and its per-branch unions are recounted from "topk", like the pairwise overlaps.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.routing.expert_sets import pairwise_overlap
from service.security.private_files import open_private
from service.types import Drafter, ModelInfo, StepRecord, accepted_positions, tree_branches

FORMAT = "moespec.steps"
VERSION = 1
_MODEL_KEYS = ("model", "num_layers", "num_experts", "top_k")
logger = logging.getLogger(__name__)


class RecordingError(ValueError):
    """A file that is not a step recording, or one whose steps lack what is needed (names the line)."""


def header_for(info: ModelInfo, hidden_size: int) -> dict:
    return {
        "format": FORMAT, "version": VERSION, "model": info.model_name, "num_layers": info.num_layers,
        "num_experts": info.num_experts, "top_k": info.top_k, "shared_experts": info.shared_experts,
        "hidden_size": hidden_size, "decode_step_seconds": info.decode_step_seconds,
    }


def _id_dtype(num_experts: int) -> np.dtype:
    return np.dtype("<u1") if num_experts <= 256 else np.dtype("<u2")


def step_line(step: StepRecord, request: int, num_experts: int) -> str:
    if step.topk_ids is None or step.window_ids is None:
        raise RecordingError("a step without top-k ids cannot be recorded (capture_topk is off)")
    ids = np.asarray(step.topk_ids, dtype=_id_dtype(num_experts))  # [L, w, m]
    return json.dumps({
        "r": request, "drafter": step.drafter.value, "k": step.draft_length, "temp": step.draft_temperature,
        "policy": step.policy_id, "drafted": step.drafted, "accepted": step.accepted, "committed": step.committed,
        "flags": "".join("1" if ok else "0" for ok in step.accepted_per_position), "w": step.window,
        "draft_s": step.draft_seconds, "verify_s": step.verify_seconds, "dse": step.decode_step_equivalents,
        "tokens": list(step.window_ids), "topk": base64.b64encode(ids.tobytes()).decode("ascii"),
        **({"tw": step.tree_width, "parents": list(step.tree_parents)} if step.tree_width > 1 else {}),
    }, separators=(",", ":"))


class StepRecorder:
    """Appends each finished request's steps; thread-safe; a write error is logged and counted,
    never raised (recording must not fail a request that generated fine)."""

    def __init__(self, path: Path, info: ModelInfo, hidden_size: int):
        self.path = Path(path)
        self.info = info
        self._lock = threading.Lock()
        self._requests = 0
        self.errors = 0
        # Opened once, up front: an unwritable path fails `serve` at start-up, not the first request.
        # Mode 0600 and never through a symlink: the file holds every request's token ids.
        self._file = open_private(self.path, append=True)
        self._file.write(json.dumps(header_for(info, hidden_size)) + "\n")
        self._file.flush()

    def write(self, steps: Sequence[StepRecord]) -> None:
        with self._lock:
            try:
                lines = [step_line(s, self._requests, self.info.num_experts) for s in steps]
                self._file.write("".join(line + "\n" for line in lines))
                self._file.flush()
                self._requests += 1
            except (OSError, ValueError):
                self.errors += 1
                logger.warning("step recording to %s failed", self.path, exc_info=self.errors == 1)

    def close(self) -> None:
        with self._lock:
            self._file.close()


@dataclass(frozen=True)
class Recording:
    header: dict
    requests: tuple[tuple[StepRecord, ...], ...]  # steps of each request, in order

    @property
    def steps(self) -> tuple[StepRecord, ...]:
        return tuple(s for r in self.requests for s in r)


def read_recording(path: Path) -> Recording:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RecordingError(f"cannot read {path}: {e.strerror}") from None
    header: dict | None = None
    requests: dict[tuple[int, int], list[StepRecord]] = {}
    section = -1
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(text.splitlines()):  # a half-written last line (killed mid-write)
                break
            raise RecordingError(f"{path}:{number}: not JSON") from None
        if row.get("format") == FORMAT:
            if header is not None and any(row.get(k) != header.get(k) for k in _MODEL_KEYS):
                raise RecordingError(f"{path}:{number}: a header for another model ({row.get('model')})")
            header, section = row, section + 1
            continue
        if header is None:
            raise RecordingError(f"{path}:{number}: no '{FORMAT}' header before the first step")
        requests.setdefault((section, row["r"]), []).append(_step(row, header, f"{path}:{number}"))
    if header is None:
        raise RecordingError(f"{path}: not a step recording (no '{FORMAT}' header)")
    return Recording(header, tuple(tuple(steps) for steps in requests.values()))


def _step(row: dict, header: dict, where: str) -> StepRecord:
    L, m, E = header["num_layers"], header["top_k"], header["num_experts"]
    try:
        w = int(row["w"])
        ids = np.frombuffer(base64.b64decode(row["topk"]), dtype=_id_dtype(E)).reshape(L, w, m)
        overlap_mean, overlap_min = pairwise_overlap(ids.astype(np.int64), E)
        drafted, accepted = int(row["drafted"]), int(row["accepted"])
        parents = tuple(int(p) for p in row.get("parents", ()))
        tree = _tree_fields(row, parents, ids, drafted, accepted) if parents else {}
        per_position = tree.pop("accepted_per_position") if tree else accepted_positions(drafted, accepted)
        return StepRecord(
            drafter=Drafter(row["drafter"]), draft_length=int(row["k"]), draft_temperature=float(row["temp"]),
            policy_id=str(row["policy"]), drafted=drafted, accepted=accepted,
            committed=int(row["committed"]),
            accepted_per_position=per_position,
            window=w, unique_experts=tuple(len(np.unique(layer)) for layer in ids),
            shared_experts=int(header.get("shared_experts", 0)), unique_experts_bound=min(E, w * m),
            draft_seconds=float(row["draft_s"]), verify_seconds=float(row["verify_s"]),
            decode_step_equivalents=float(row["dse"]),
            topk_ids=tuple(tuple(tuple(p) for p in layer) for layer in ids.tolist()),
            window_ids=tuple(int(t) for t in row["tokens"]),
            pairwise_overlap_mean=overlap_mean, pairwise_overlap_min=overlap_min,
            tree_width=int(row.get("tw", 1)), **tree,
        )
    except (KeyError, ValueError, TypeError) as e:
        raise RecordingError(f"{where}: malformed step ({e})") from None


def _tree_fields(row: dict, parents: tuple[int, ...], ids: np.ndarray, drafted: int, accepted: int) -> dict:
    """A tree step's acceptance (from its flags) and per-branch unions (from its [L, w, m] ids: window
    position 0 is the first token, position i + 1 node i); ValueError when they do not fit together."""
    if len(parents) != drafted or ids.shape[1] != drafted + 1:
        raise ValueError(f"{len(parents)} tree parents and a {ids.shape[1]}-position window for {drafted} drafts")
    flags = tuple(c == "1" for c in str(row["flags"]))
    path = [i for i, ok in enumerate(flags) if ok]
    if len(flags) != drafted or len(path) != accepted or any(
            parents[node] != (path[d - 1] if d else -1) for d, node in enumerate(path)):
        raise ValueError(f"flags {row['flags']!r} are not a path of {accepted} nodes from the tree's root")
    branches = tree_branches(parents)  # refuses parents that are not a tree
    unions = tuple(tuple(len(np.unique(layer[[0, *(n + 1 for n in branch)]])) for layer in ids) for branch in branches)
    return {"accepted_per_position": flags, "tree_parents": parents, "branch_unique": unions}
