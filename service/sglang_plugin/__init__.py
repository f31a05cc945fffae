"""moespec's SGLang plugin: the code that runs inside SGLang's scheduler process.

SGLang loads `load` from the `sglang.srt.plugins` entry point first thing in every scheduler
process. It does nothing unless the moespec backend switched it on for that engine (wire.TAP_ENV in
the environment the scheduler inherits), so a user's other SGLang servers in the same environment
are untouched. Switched on, it registers two hooks (hook_points.py) that measure every target pass
(tap.py, statistics.py) and push one record per pass to the moespec server (sender.py). What crosses
the process boundary, and in which format, is written in wire.py alone; the server side reads it in
service/sglang_backend/stats_channel.py.
"""

from __future__ import annotations

import os


def load() -> None:
    """The entry point: inert without wire.TAP_ENV."""
    from service.sglang_plugin import wire

    config = wire.TapConfig.from_env(os.environ.get(wire.TAP_ENV))
    if config is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from service.sglang_plugin import hook_points
    from service.sglang_plugin.tap import TapState

    state = TapState(config)
    HookRegistry.register(hook_points.RECORDER_FACTORY, state.wrap_recorder, HookType.AFTER)
    HookRegistry.register(hook_points.MODEL_FORWARD, state.around_forward, HookType.AROUND)
