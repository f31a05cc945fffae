"""One sglang.Engine on a thread of its own, which runs the engine's asyncio loop.

SGLang's blocking `Engine.generate` drives its loop with `run_until_complete`, which threads cannot
share; its async API can serve any number of requests at once, but only on the loop the engine was
built on. So each engine gets a thread: it builds the engine (which binds its sockets to that
thread's loop), then runs the loop forever. Server threads submit coroutines to it and read the
chunks from a queue; a request needs no lock, and SGLang's scheduler batches whatever is in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Iterator
from types import ModuleType

log = logging.getLogger(__name__)

_END = object()
TICK_SECONDS = 0.05  # how often a waiting reader wakes to poll its cancellation and deadline


class EngineThread:
    def __init__(self, sglang: ModuleType, kwargs: dict, recorder: bool = False):
        """Blocks until the engine is up (or raises what its start-up raised)."""
        self._sglang, self._kwargs = sglang, dict(kwargs)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.engine = None
        self.loop: asyncio.AbstractEventLoop | None = None
        log.info("starting sglang.Engine(%s)", ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items())))
        t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._main, name="sglang-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        if recorder:
            # Before any forward pass: on CPU, a pass with recording mode on but not started asks the
            # CUDA module whether it is capturing, and the scheduler dies. On the running loop: driven
            # by run_until_complete before it, SGLang's tokenizer manager binds its loop wrong and
            # no request reaches the scheduler afterwards.
            self._call(self.engine.tokenizer_manager.start_expert_distribution_record())
        log.info("sglang engine up in %.1f s", time.perf_counter() - t0)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self.engine = self._sglang.Engine(**self._kwargs)
        except BaseException as e:  # handed to the thread that asked for the engine
            self._error = e
            self._ready.set()
            loop.close()
            return
        self.loop = loop
        self._ready.set()
        loop.run_forever()
        # Stopped: cancel what SGLang's tokenizer manager still has waiting on its sockets, so the loop
        # closes clean instead of destroying pending tasks.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

    def stream(self, input_ids: list[int], sampling_params: dict, rid: str) -> Iterator[dict | None]:
        """SGLang's chunks (cumulative output_ids, text, meta_info) as they come; None every TICK_SECONDS
        without one, so the reader can poll its cancellation while a request waits in SGLang's queue."""
        chunks: queue.SimpleQueue = queue.SimpleQueue()

        async def pump() -> None:
            try:
                generator = await self.engine.async_generate(input_ids=input_ids, sampling_params=sampling_params,
                                                             stream=True, rid=rid)
                async for chunk in generator:
                    chunks.put(chunk)
                chunks.put(_END)
            except BaseException as e:  # the reader raises it
                chunks.put(e)

        asyncio.run_coroutine_threadsafe(pump(), self.loop)
        while True:
            try:
                item = chunks.get(timeout=TICK_SECONDS)
            except queue.Empty:
                yield None
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def abort(self, rid: str) -> None:
        # Engine has no abort method; its tokenizer manager's is what /abort_request calls (on the loop).
        self.loop.call_soon_threadsafe(lambda: self.engine.tokenizer_manager.abort_request(rid=rid))

    def dump_recorder(self) -> None:
        """SGLang's per_token recorder writes what it holds to its directory (cross-check mode only)."""
        self._call(self.engine.tokenizer_manager.dump_expert_distribution_record())

    def pin_draft_steps(self, steps: int) -> None:
        """An adaptive EAGLE engine drafts `steps` per verify pass from its next batch on (the plugin's
        step pin answers the RPC in every scheduler rank; service/sglang_plugin/step_pin.py)."""
        from service.sglang_plugin.wire import PIN_METHOD

        try:  # SGLang's RPC socket is its own (not the loop's): a blocking call from this thread is safe
            self.engine.collective_rpc(PIN_METHOD, steps=steps)
        except AssertionError as e:  # collective_rpc asserts the scheduler's answer
            raise RuntimeError(f"SGLang did not pin {steps} draft steps: {e}") from None

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def shutdown(self) -> None:
        """Stop the loop, then the engine (which blocks until the scheduler released its device)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=60)
        self.engine.shutdown()
