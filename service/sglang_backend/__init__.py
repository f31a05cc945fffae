"""The SGLang backend: `moespec serve --backend sglang` on a CUDA GPU with SGLang 0.5.23.

Importing this package imports neither sglang nor CUDA: `add_arguments(parser)` and
`create_backend(args)` (the two names serve_cli calls) check everything and import sglang only
when a backend is actually created. See README.md beside this file.
"""

from service.sglang_backend.cli import add_arguments, create_backend

__all__ = ["add_arguments", "create_backend"]
