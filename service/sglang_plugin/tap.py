"""The tap: SGLang's expert recorder as seen by the model, with moespec's statistics beside it.

Two hook points (hook_points.py) meet here:
- the recorder SGLang creates (`ExpertDistributionRecorder.init_new`) is wrapped in a `RecorderTap`,
  which forwards every call to it unchanged (so SGLang's own `per_token` recorder, when switched on,
  still records) and feeds each MoE layer's routed ids to `PassStatistics` under the layer index the
  model announces with `with_current_layer`;
- the model runner's `forward` marks where a target pass begins and ends: `begin` eagerly clears the
  buffers before the pass (before a CUDA-graph replay too), `end` computes the statistics on the
  device and hands them to the sender with an event, so the scheduler never waits for the copy.
Only DECODE and TARGET_VERIFY passes of the target model are measured: those are the steps; the
drafter's passes and prefills send nothing.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

import torch

from service.sglang_plugin import wire
from service.sglang_plugin.sender import Sender
from service.sglang_plugin.statistics import PassStatistics

log = logging.getLogger(__name__)


class TapState:
    """What one scheduler process's tap holds: the config, the sender, the recorder tap once SGLang made one."""

    def __init__(self, config: wire.TapConfig):
        self.config = config
        self.sender = Sender(config.endpoint)
        self.recorder: RecorderTap | None = None

    def wrap_recorder(self, recorder, *args, **kwargs):
        """AFTER hook of ExpertDistributionRecorder.init_new(expert_location_metadata, rank): the
        recorder SGLang made, wrapped."""
        metadata = args[0] if args else kwargs.get("expert_location_metadata")
        if metadata is None:  # a model without expert-location metadata has no routed experts to count
            return recorder
        mapping = metadata.physical_to_logical_map  # [L, P] on the device
        layers, experts = int(mapping.shape[0]), int(metadata.num_logical_experts)
        statistics = PassStatistics(layers, experts, mapping, mapping.device, self.config.capture_topk)
        self.recorder = RecorderTap(recorder, statistics)
        self.sender.hello(wire.Hello(pid=os.getpid(), layers=layers, experts=experts))
        return self.recorder

    def around_forward(self, original, runner, *args, **kwargs):
        """AROUND hook of ModelRunner.forward(self, forward_batch, ...)."""
        tap = self.recorder
        forward_batch = kwargs["forward_batch"] if "forward_batch" in kwargs else args[0]
        mode = forward_batch.forward_mode
        measured = (tap is not None and not runner.is_draft_worker and forward_batch.batch_size > 0
                    and (mode.is_decode() or mode.is_target_verify()))
        if not measured:
            if tap is not None:
                tap.measuring = False
            return original(runner, *args, **kwargs)
        tokens, batch = int(forward_batch.input_ids.shape[0]), int(forward_batch.batch_size)
        if tokens % batch:
            log.warning("moespec tap: a %s pass of %d tokens for %d requests is not request-major; skipped",
                        mode.name, tokens, batch)
            tap.measuring = False
            return original(runner, *args, **kwargs)
        start_ns = time.time_ns()
        tap.statistics.begin(tokens)
        tap.measuring = True
        try:
            output = original(runner, *args, **kwargs)
        finally:
            tap.measuring = False
        self._send(tap.statistics, forward_batch, runner.forward_pass_id, batch, tokens // batch, start_ns)
        return output

    def _send(self, statistics: PassStatistics, forward_batch, pass_id: int, batch: int, width: int,
              start_ns: int) -> None:
        links = _tree_links(forward_batch.spec_info, batch, width)
        # Path unions only for real trees (EAGLE topk > 1): chains and NGRAM windows carry links too, and
        # the server reads branches of tree policies alone.
        tree = links if getattr(forward_batch.spec_info, "topk", 1) > 1 else {}
        device_tensors = statistics.finish(batch, width, tree.get("next_token"), tree.get("next_sibling"))
        n = batch * width
        device_tensors["input_ids"] = forward_batch.input_ids[:n].to(torch.int32)
        device_tensors["positions"] = forward_batch.positions[:n].to(torch.int32)
        device_tensors.update(links)
        if statistics.device.type == "cuda":
            host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                    for k, v in device_tensors.items()}
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = {k: v.contiguous() for k, v in device_tensors.items()}, None
        header = {"pass_id": pass_id, "mode": int(forward_batch.forward_mode), "rids": tuple(forward_batch.rids),
                  "width": width, "start_ns": start_ns, "end_ns": time.time_ns()}
        self.sender.pass_stats(header, host, ready)


class RecorderTap:
    """Stands in for SGLang's global expert recorder: every call goes to the real one; routed ids of a
    measured pass (or of a CUDA-graph capture) also go to the statistics."""

    def __init__(self, inner, statistics: PassStatistics):
        self._inner = inner
        self.statistics = statistics
        self.measuring = False
        self._layer: int | None = None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @contextmanager
    def with_current_layer(self, layer_idx):
        previous, self._layer = self._layer, layer_idx
        try:
            with self._inner.with_current_layer(layer_idx):
                yield
        finally:
            self._layer = previous

    def on_select_experts(self, topk_ids: torch.Tensor):
        self._inner.on_select_experts(topk_ids=topk_ids)
        if self._layer is not None and (self.measuring or _capturing(topk_ids)):
            self.statistics.on_routed(self._layer, topk_ids)


def _tree_links(spec_info, batch: int, width: int) -> dict[str, torch.Tensor]:
    """A verify pass's draft trees as SGLang links them ([B, w] first child / next sibling, NGRAM and
    EAGLE alike); {} where the pass carries none (plain decode), and the server reads chains."""
    first = getattr(spec_info, "retrieve_next_token", None)
    sibling = getattr(spec_info, "retrieve_next_sibling", None)
    if not isinstance(first, torch.Tensor) or not isinstance(sibling, torch.Tensor) or width < 2:
        return {}
    if first.numel() < batch * width or sibling.numel() < batch * width:
        return {}
    return {"next_token": first.reshape(-1)[:batch * width].to(torch.int16),
            "next_sibling": sibling.reshape(-1)[:batch * width].to(torch.int16)}


def _capturing(tensor: torch.Tensor) -> bool:
    """A CUDA graph is being captured: record the ops, whatever pass it will replay for."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()
