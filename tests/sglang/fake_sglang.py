"""A stand-in for `sglang.Engine` *and its scheduler* that replays what a real SGLang 0.5.23 recorded
(tests/fixtures/sglang/speculative: two requests batched, STANDALONE k = 3) through moespec's real
plugin code: the scheduler's recorder is wrapped by `TapState.wrap_recorder`, every recorded target
pass runs through `TapState.around_forward` with a "model" that announces each layer and hands its
recorded routed ids to the recorder, and the records reach the backend over the real channel.

So in the main test suite the backend's own code (swap gate, engine thread, channel, joining,
calibration) and the plugin's statistics and wire run for real; only SGLang's scheduler is replaced
by a replay of its recorded routing. The real SGLang runs in tests/sglang/test_sglang_cpu.py.
"""

from __future__ import annotations

import asyncio
import os
import types

import torch

from service.sglang_backend.attribution import RequestTokens, attribute, segments
from service.sglang_backend.records import ForwardMode, dump_files, load_dump
from service.sglang_plugin.tap import TapState
from service.sglang_plugin.wire import TAP_ENV, TapConfig
from tests.fixtures.sglang.scenario import load

SCENARIO = load("speculative")
WIDTH = SCENARIO.draft_length + 1


def _recorded_passes() -> list[tuple[object, list[str | None]]]:
    """The fixture's TARGET_VERIFY passes with, per request segment, the name of the request it belongs to."""
    passes = [p for path in dump_files(SCENARIO.folder) for p in load_dump(path)]
    names = list(SCENARIO.expected)
    tokens = [RequestTokens(tuple(SCENARIO.expected[n]["prompt_ids"]), tuple(SCENARIO.expected[n]["output_ids"]))
              for n in names]
    windows = attribute(passes, tokens, speculative=True, verify_width=WIDTH,
                        moe_layers=SCENARIO.geometry.moe_layers)
    owner = {(w.pass_index, w.input_ids): name for name, found in zip(names, windows, strict=True) for w in found}
    out = []
    for p in passes:
        if p.mode != ForwardMode.TARGET_VERIFY or not p.has_routing(SCENARIO.geometry.moe_layers):
            continue
        out.append((p, [owner.get((p.index, p.input_ids[offset:offset + length]))
                        for offset, length in segments(p, WIDTH)]))
    return out


RECORDED = _recorded_passes()


class _Mode(int):
    """ForwardMode as the tap reads it: an int with is_decode / is_target_verify."""

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    @property
    def name(self) -> str:
        return ForwardMode(self).name


class _NoopRecorder:
    def with_current_layer(self, layer_idx):
        return _nothing()

    def on_select_experts(self, topk_ids):
        pass


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _chain_links(batch: int, width: int) -> types.SimpleNamespace:
    """The verify input's tree links as SGLang fills them for chains (STANDALONE/EAGLE, topk 1)."""
    first_child = torch.arange(1, width + 1).masked_fill(torch.arange(width) == width - 1, -1)
    return types.SimpleNamespace(retrieve_next_token=first_child.repeat(batch, 1),
                                 retrieve_next_sibling=torch.full((batch, width), -1))


class FakeEngine:
    def __init__(self, journal: list, **kwargs):
        self.kwargs, self.journal = kwargs, journal
        self.recording = self.closed = False
        self.aborted: set[str] = set()
        self.in_flight: dict[str, str] = {}  # request name -> rid
        self.replayed: dict[int, list[str]] = {}  # recorded pass -> the rids it last ran for (a shared pass runs once)
        self.tokenizer_manager = types.SimpleNamespace(abort_request=lambda rid: self.aborted.add(rid))
        config = TapConfig.from_env(os.environ.get(TAP_ENV))
        self.tap = None
        if config is not None:
            self.tap = TapState(config)
            geometry = SCENARIO.geometry
            metadata = types.SimpleNamespace(
                physical_to_logical_map=torch.arange(geometry.num_experts).repeat(geometry.num_hidden_layers, 1),
                num_logical_experts=geometry.num_experts)
            self.recorder = self.tap.wrap_recorder(_NoopRecorder(), metadata)
        journal.append(self)

    @property
    def replays(self) -> bool:
        """Only an engine started like the fixture's run (STANDALONE, 4 draft tokens) replays its passes."""
        return self.tap is not None and self.kwargs.get("speculative_num_draft_tokens") == WIDTH

    def start_expert_distribution_record(self):
        self.recording = True

    def _forward(self, recorded) -> list[str]:
        """One target pass through the plugin's hooks (the 'model' announces each layer and routes); the
        rids it ran for."""
        p, owners = recorded
        batch = types.SimpleNamespace(
            forward_mode=_Mode(ForwardMode.TARGET_VERIFY), batch_size=len(owners),
            input_ids=torch.tensor(p.input_ids), positions=torch.tensor(p.positions),
            rids=[self.in_flight.get(name, f"someone-else-{i}") for i, name in enumerate(owners)],
            spec_info=_chain_links(len(owners), WIDTH))

        def model(runner, forward_batch):
            for layer in range(p.topk_ids.shape[0]):
                with self.recorder.with_current_layer(layer):
                    self.recorder.on_select_experts(topk_ids=p.physical_ids[layer])

        runner = types.SimpleNamespace(is_draft_worker=False, forward_pass_id=p.index)
        self.tap.around_forward(model, runner, batch)
        return batch.rids

    async def async_generate(self, input_ids, sampling_params, stream, rid):
        assert stream and not self.closed
        # A forward pass with recorder mode on but recording not yet started kills SGLang's scheduler on
        # a CPU (sglang-cpu-notes finding 5), so nothing may run before the recorder starts.
        assert self.recording or "expert_distribution_recorder_mode" not in self.kwargs
        name = next((n for n, e in SCENARIO.expected.items() if tuple(e["prompt_ids"]) == tuple(input_ids)), None)
        return self._generate(name, sampling_params, rid)

    async def _generate(self, name, sampling_params, rid):
        if name is None:  # the warm-up request
            output = list(range(100, 100 + sampling_params["max_new_tokens"]))
            meta = {"finish_reason": {"type": "length"}, "completion_tokens": len(output)}
            passes = []
        else:
            output, meta = SCENARIO.expected[name]["output_ids"], SCENARIO.meta[name]
            passes = [r for r in RECORDED if name in r[1]] if self.replays else []
            self.in_flight[name] = rid
        try:
            yield {"text": str(output[0]), "output_ids": output[:1], "meta_info": {"finish_reason": None}}
            for step, recorded in enumerate(passes, start=1):
                await asyncio.sleep(0.002)
                if rid in self.aborted:
                    break
                await self._batch_with(recorded[1])
                if rid not in self.replayed.get(recorded[0].index, ()):
                    self.replayed[recorded[0].index] = self._forward(recorded)
                yield {"text": " ".join(map(str, output[:step + 1])), "output_ids": output[:step + 1],
                       "meta_info": {"finish_reason": None}}
            if rid in self.aborted:
                yield {"text": "", "output_ids": output[:1], "meta_info": {"finish_reason": {"type": "abort"}}}
                return
            await asyncio.sleep(0.002)
            yield {"text": " ".join(map(str, output)), "output_ids": output, "meta_info": meta}
        finally:
            self.in_flight.pop(name, None)

    async def _batch_with(self, owners, grace: float = 0.2) -> None:
        """As a scheduler batches what is in flight: give the pass's other requests a moment to arrive
        (a request submitted at the same time as this one), else run without them."""
        deadline = asyncio.get_running_loop().time() + grace
        while any(name not in self.in_flight for name in owners if name is not None):
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.005)

    def dump_expert_distribution_record(self):
        assert self.recording  # SGLang raises without a per_token recorder started

    def shutdown(self):
        self.closed = True
