"""Run llama.cpp's `convert_hf_to_gguf.py` on a shipped checkpoint (scripts/setup_llama_cpp.sh).

The converter names a BPE tokenizer's pre-tokenization (the regex that splits text before BPE) by
hashing the tokens of a test string, and knows only the hashes of published tokenizers, so it
refuses the shipped one, which was trained here. The shipped tokenizer splits with exactly Qwen2's
regex, which llama.cpp implements under the name "qwen2". This wrapper gives the converter that
name when, and only when, the converter does not recognise the tokenizer and its `tokenizer.json`
carries Qwen2's regex; everything else runs as the converter wrote it.

usage: llama_cpp_convert.py LLAMA_CPP_SRC MODEL_DIR [converter flags, e.g. --outtype bf16 --outfile F]
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def split_regexes(tokenizer_json: Path) -> list[str]:
    pre = json.loads(tokenizer_json.read_text()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    return [s["pattern"]["Regex"] for s in steps if s.get("type") == "Split" and "Regex" in s.get("pattern", {})]


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    src, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion.base import TextModel  # the converter's own package, from its source tree

    recognised = TextModel.get_vocab_base_pre
    is_qwen2 = split_regexes(model_dir / "tokenizer.json") == [QWEN2_SPLIT]

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            if not is_qwen2:
                raise
            return "qwen2"

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(src / "convert_hf_to_gguf.py"), str(model_dir), *sys.argv[3:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
