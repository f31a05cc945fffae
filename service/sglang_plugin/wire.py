"""What crosses from SGLang's scheduler process to moespec's server process: the one place the
boundary is written down. Both sides import this module; it imports neither torch nor SGLang.

Transport: a ZeroMQ PUSH socket in the scheduler (service/sglang_plugin/sender.py) connected to a
PULL socket the backend binds on a private `ipc://` path (service/sglang_backend/stats_channel.py).
ZeroMQ because SGLang already ships it and speaks it between its own processes; PUSH/PULL because
records flow one way, are queued by ZeroMQ's I/O thread without blocking the scheduler, and stay in
order per connection. The endpoint and options reach the scheduler in one environment variable
(`TAP_ENV`), set by the backend just before it starts the engine; without it the tap is inert.
(`EAGLE_TARGET_ENV`, `STEP_PIN_ENV` and `TREE_TAU_ENV` switch the plugin's other parts, embed_head.py,
step_pin.py and tree_ranking.py, which send nothing.)

Messages are multipart: frame 0 a small JSON header, the rest raw little-endian arrays (no pickle:
nothing the server reads can run code). Version 3:

hello  {"v": 3, "kind": "hello", "pid", "layers": L, "experts": E}  once per tap, when SGLang made
       its expert recorder (model loaded, before any pass): proof the plugin runs in that scheduler.
pass   {"v": 3, "kind": "pass", "pass": id, "mode": SGLang ForwardMode value, "rids": [B request ids
       in batch order], "width": w tokens per request, "layers": L, "topk": m or 0, "tree": 0 or 1,
       "paths": 0 or 1,
       "start_ns", "end_ns": wall clock around the target's forward}
       frames: input_ids int32 [B*w], positions int32 [B*w],
               unions int16 [B, L]: distinct routed experts of each request's window per layer,
               batch_union int16 [L]: distinct routed experts of the whole pass per layer,
               pair_mean float32 [B, L], pair_min int16 [B, L]: mean and smallest size of the
                 pairwise intersections of the window positions' expert sets (w = 1: the one set's size),
               (only when tree) next_token int16 [B*w], next_sibling int16 [B*w]: each window's draft
                 tree as SGLang's verify input links it (first child, next sibling; window-local node
                 indices, -1 = none); without them a window is a chain,
               (only when paths, EAGLE trees of topk > 1) path_unions int16 [B, w, L]: distinct routed
                 experts over each node's path (the window's first token down to the node; a leaf's is
                 its branch's union),
               (only when topk > 0) topk int16 [L, B*w, m]: the routed *physical* slot ids, -1 = none.
       One per DECODE or TARGET_VERIFY pass of the target model; the drafter's passes and prefills
       send none. Tokens are request-major: request b owns tokens [b*w, (b+1)*w).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

VERSION = 3
TAP_ENV = "MOESPEC_SGLANG_TAP"  # JSON {"endpoint": "ipc://...", "capture_topk": bool}; absent: plugin inert
# "1": give a Qwen2-MoE target the embedding/head lookup EAGLE drafts need (embed_head.py); absent: untouched.
EAGLE_TARGET_ENV = "MOESPEC_SGLANG_EAGLE_TARGET"
# "1": moespec sets the draft step count of an adaptive EAGLE engine (step_pin.py); absent: SGLang's rule does.
STEP_PIN_ENV = "MOESPEC_SGLANG_STEP_PIN"
# A float: the temperature the plugin ranks an EAGLE tree's draft candidates at (tree_ranking.py); absent: SGLang's.
TREE_TAU_ENV = "MOESPEC_SGLANG_TREE_TAU"
# The scheduler method `Engine.collective_rpc` names to pin the draft step count, parameter `steps`: int.
PIN_METHOD = "moespec_pin_draft_steps"


class WireError(ValueError):
    """A message that is not a version-1 record (another moespec, or garbage on the socket)."""


@dataclass(frozen=True)
class TapConfig:
    endpoint: str
    capture_topk: bool = False

    def to_env(self) -> str:
        return json.dumps({"endpoint": self.endpoint, "capture_topk": self.capture_topk})

    @classmethod
    def from_env(cls, value: str | None) -> TapConfig | None:
        if not value:
            return None
        raw = json.loads(value)
        return cls(endpoint=str(raw["endpoint"]), capture_topk=bool(raw.get("capture_topk", False)))


@dataclass(frozen=True)
class Hello:
    pid: int
    layers: int
    experts: int


@dataclass(frozen=True)
class PassStats:
    """One target pass as the scheduler saw it. Arrays are numpy, shapes as in the module docstring."""

    pass_id: int
    mode: int
    rids: tuple[str, ...]  # [B]
    width: int  # w
    start_ns: int
    end_ns: int
    input_ids: np.ndarray  # [B*w] int32
    positions: np.ndarray  # [B*w] int32
    unions: np.ndarray  # [B, L] int16
    batch_union: np.ndarray  # [L] int16
    pair_mean: np.ndarray  # [B, L] float32
    pair_min: np.ndarray  # [B, L] int16
    topk: np.ndarray | None = None  # [L, B*w, m] int16 physical slot ids
    next_token: np.ndarray | None = None  # [B*w] int16 first child of each node (None: chains)
    next_sibling: np.ndarray | None = None  # [B*w] int16 next sibling of each node
    path_unions: np.ndarray | None = None  # [B, w, L] int16 distinct experts over each node's path (EAGLE trees)

    @property
    def batch_size(self) -> int:
        return len(self.rids)

    def window(self, b: int) -> slice:
        return slice(b * self.width, (b + 1) * self.width)


def encode_hello(hello: Hello) -> list[bytes]:
    return [json.dumps({"v": VERSION, "kind": "hello", "pid": hello.pid, "layers": hello.layers,
                        "experts": hello.experts}).encode()]


def encode_pass(p: PassStats) -> list[bytes]:
    header = {"v": VERSION, "kind": "pass", "pass": p.pass_id, "mode": p.mode, "rids": list(p.rids),
              "width": p.width, "layers": int(p.batch_union.shape[0]),
              "topk": 0 if p.topk is None else int(p.topk.shape[-1]), "tree": int(p.next_token is not None),
              "paths": int(p.path_unions is not None),
              "start_ns": p.start_ns, "end_ns": p.end_ns}
    frames = [json.dumps(header).encode()]
    for array, dtype in ((p.input_ids, "<i4"), (p.positions, "<i4"), (p.unions, "<i2"), (p.batch_union, "<i2"),
                         (p.pair_mean, "<f4"), (p.pair_min, "<i2")):
        frames.append(np.ascontiguousarray(array, dtype=dtype).tobytes())
    if p.next_token is not None:
        frames += [np.ascontiguousarray(p.next_token, dtype="<i2").tobytes(),
                   np.ascontiguousarray(p.next_sibling, dtype="<i2").tobytes()]
    if p.path_unions is not None:
        frames.append(np.ascontiguousarray(p.path_unions, dtype="<i2").tobytes())
    if p.topk is not None:
        frames.append(np.ascontiguousarray(p.topk, dtype="<i2").tobytes())
    return frames


def decode(frames: list[bytes]) -> Hello | PassStats:
    try:
        header = json.loads(frames[0])
    except (ValueError, IndexError) as e:
        raise WireError(f"not a moespec tap message: {e}") from None
    if not isinstance(header, dict) or header.get("v") != VERSION:
        raise WireError(f"tap message version {header.get('v') if isinstance(header, dict) else '?'}, "
                        f"this server reads {VERSION}")
    if header["kind"] == "hello":
        return Hello(pid=int(header["pid"]), layers=int(header["layers"]), experts=int(header["experts"]))
    if header["kind"] != "pass":
        raise WireError(f"unknown tap message kind {header['kind']!r}")
    rids, w, layers, m = tuple(header["rids"]), int(header["width"]), int(header["layers"]), int(header["topk"])
    b, n, tree = len(rids), len(rids) * int(header["width"]), bool(header.get("tree"))
    paths = tree and bool(header.get("paths"))
    expected = 7 + (2 if tree else 0) + (1 if paths else 0) + (1 if m else 0)
    if len(frames) != expected:
        raise WireError(f"pass message with {len(frames)} frames, expected {expected}")

    def array(frame: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        out = np.frombuffer(frame, dtype=dtype)
        if out.size != int(np.prod(shape)):
            raise WireError(f"pass {header['pass']}: a frame of {out.size} values, expected shape {shape}")
        return out.reshape(shape)

    return PassStats(
        pass_id=int(header["pass"]), mode=int(header["mode"]), rids=rids, width=w,
        start_ns=int(header["start_ns"]), end_ns=int(header["end_ns"]),
        input_ids=array(frames[1], "<i4", (n,)), positions=array(frames[2], "<i4", (n,)),
        unions=array(frames[3], "<i2", (b, layers)), batch_union=array(frames[4], "<i2", (layers,)),
        pair_mean=array(frames[5], "<f4", (b, layers)), pair_min=array(frames[6], "<i2", (b, layers)),
        next_token=array(frames[7], "<i2", (n,)) if tree else None,
        next_sibling=array(frames[8], "<i2", (n,)) if tree else None,
        path_unions=array(frames[9], "<i2", (b, w, layers)) if paths else None,
        topk=array(frames[-1], "<i2", (layers, n, m)) if m else None,
    )
