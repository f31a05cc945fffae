"""`moespec serve --backend sglang` options and the factory serve_cli calls.

Every option has a default, because serve_cli adds them whatever --backend is; they are checked
only in create_backend. Options that exist only for this backend carry an --sglang- prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

from service.errors import UsageError
from service.routing import expert_parallel
from service.security.private_files import private_dir
from service.sglang_backend import device as devices
from service.sglang_backend.checkpoint import sglang_model_dir
from service.sglang_backend.ep import EPConfig, ep_config
from service.sglang_backend.info import build_info
from service.sglang_backend.model_config import ModelDirError
from service.sglang_backend.policy import (
    ADAPTIVE_ALGORITHMS,
    MODEL_ALGORITHMS,
    NEEDS_DRAFT_PATH,
    SHARES_TARGET_EMBEDDING,
    TREE_ALGORITHMS,
    SpecConfig,
    adaptive_config,
    max_tree_width,
)
from service.sglang_backend.preflight import (
    check_draft,
    check_eagle_target_hook,
    check_plugin_hooks,
    check_step_pin_hooks,
    check_target,
    check_tree_ranking_hook,
    import_sglang,
    require_cpu_kernels,
    require_cuda,
)
from service.types import MAX_DRAFT_LENGTH, Drafter, DraftPolicy, InvalidRequest

ALGORITHMS = (*MODEL_ALGORITHMS, "NGRAM")
# Beside an EAGLE draft's checkpoint: {"greedy_temperature": TAU} to rank its trees at (--sglang-tree-temperature auto).
TREE_RANKING_FILE = "tree_ranking.json"
# The shipped EAGLE-3 draft (SGLang's LlamaForCausalLMEagle3 format), trained against the shipped target:
# what --speculative-algorithm EAGLE3 drafts with unless --draft-model-path names another.
DEFAULT_EAGLE3_DRAFT = Path(__file__).resolve().parents[1] / "models" / "eagle3"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sglang backend (--backend sglang)")
    group.add_argument("--device", choices=devices.DEVICES, default=devices.CUDA,
                       help="where SGLang computes: cuda (default) or cpu (SGLang's CPU mode; needs "
                            "sgl-kernel's CPU ops, see service/sglang_backend/README.md)")
    group.add_argument("--model-path", type=Path, help="target MoE model directory (Hugging Face layout)")
    group.add_argument("--draft-model-path", type=Path,
                       help="draft model directory (STANDALONE: a small model with the target's tokenizer; "
                            "EAGLE3: an EAGLE-3 checkpoint, default the shipped service/models/eagle3)")
    group.add_argument("--speculative-algorithm", type=str.upper, choices=ALGORITHMS,
                       help="SGLang algorithm behind the model drafter (default STANDALONE with "
                            "--draft-model-path); NGRAM offers the n-gram drafter only")
    group.add_argument("--sglang-prepared-lengths", default="auto", metavar="LIST",
                       help="EAGLE/EAGLE3: draft lengths one engine serves, switched at run time without an "
                            f"engine restart (comma-separated, e.g. 0,2,4; 0 = plain decoding on that engine; "
                            f"default auto = 0-{MAX_DRAFT_LENGTH}; none: every length change restarts the "
                            "engine). Other algorithms: none")
    group.add_argument("--sglang-tree-temperature", default="auto", metavar="TAU",
                       help="EAGLE/EAGLE3 draft trees: rank the candidates by the draft's probabilities at this "
                            "temperature (below 1 where the draft's softmax is flatter than its argmax is right; "
                            "1: SGLang's own ranking). Default auto: what the draft directory's "
                            f"{TREE_RANKING_FILE} records (the shipped EAGLE-3 draft records its fit), else 1. "
                            "Lossless either way")
    group.add_argument("--sglang-no-ngram", action="store_true",
                       help="do not offer SGLang's NGRAM as a second drafter")
    group.add_argument("--sglang-tp", type=int, default=1, help="tensor-parallel GPUs")
    group.add_argument("--sglang-mem-fraction", type=float, help="mem_fraction_static (SGLang picks by default)")
    group.add_argument("--sglang-context-length", type=int, help="context length (default: the model's)")
    group.add_argument("--sglang-chunked-prefill", type=int,
                       help="chunked_prefill_size (default 4096 on cuda, 256 on cpu; the per_token recorder "
                            "sizes its buffer from it)")
    group.add_argument("--sglang-ngram-max-trie-depth", type=int, help="speculative_ngram_max_trie_depth")
    group.add_argument("--sglang-no-expert-record", action="store_true",
                       help="run without moespec's routing statistics in SGLang's scheduler (counts only, no "
                            "expert unions)")
    group.add_argument("--sglang-record-dir", type=Path,
                       help="cross-check: also run SGLang's own per_token expert recorder and have it dump there "
                            "whenever an engine stops (raw evidence for offline checks; grows with traffic)")
    group.add_argument("--sglang-capture-topk", action="store_true", help="keep [L, w, m] routed ids per step")
    group.add_argument("--sglang-no-calibrate", action="store_true",
                       help="skip the plain-decoding start-up run that calibrates the decode step")
    group.add_argument("--sglang-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="any other sglang.Engine argument (VALUE parsed as JSON, else a string); repeatable")


def create_backend(args: argparse.Namespace):
    """Checks (model directories, EP and recording flags, then sglang, then CUDA unless --device cpu)
    and the started backend."""
    from service.sglang_backend.backend import BackendConfig, SGLangBackend

    target = check_target(args.model_path)
    ep = ep_from_args(args, target)
    record_steps = record_steps_path(args)
    algorithm = args.speculative_algorithm or ("STANDALONE" if args.draft_model_path else "NGRAM")
    model_algorithm = None if algorithm == "NGRAM" else algorithm
    draft_path = args.draft_model_path or (DEFAULT_EAGLE3_DRAFT if algorithm == "EAGLE3" else None)
    draft_name = check_draft(draft_path, model_algorithm, NEEDS_DRAFT_PATH)
    prepared = prepared_lengths(args.sglang_prepared_lengths, model_algorithm)
    tree_tau = tree_temperature_from_flag(args.sglang_tree_temperature, model_algorithm, draft_path)
    spec = SpecConfig(
        model_algorithm=model_algorithm,
        draft_model_path=str(draft_path) if draft_path else None,
        ngram=algorithm == "NGRAM" or not args.sglang_no_ngram,
        ngram_max_trie_depth=args.sglang_ngram_max_trie_depth,
        prepared_lengths=prepared,
        tree_ranking_temperature=tree_tau,
    )
    base = base_kwargs(args)
    policy = initial_policy(args, spec)
    # SGLang reads its CPU switch when its modules are imported: set before the import.
    os.environ.update(devices.environment(args.device, dict(os.environ)))
    sglang = import_sglang()
    if args.device == devices.CUDA:
        require_cuda()
    else:
        require_cpu_kernels()
    if not args.sglang_no_expert_record:
        check_plugin_hooks()
    if model_algorithm in SHARES_TARGET_EMBEDDING:
        check_eagle_target_hook()
    if prepared:
        check_step_pin_hooks()
    if tree_tau != 1.0:
        check_tree_ranking_hook()
    cleanup = []
    try:
        served, is_view = sglang_model_dir(args.model_path)
    except ModelDirError as e:
        raise UsageError(f"--model-path {e}") from None
    if is_view:
        cleanup.append(served)
    base["model_path"] = str(served)
    record_dir = args.sglang_record_dir
    if record_dir is not None:
        try:  # the dumps hold token ids: a private folder only
            private_dir(record_dir)
        except OSError as e:
            raise UsageError(f"--sglang-record-dir: {e}") from None
    if prepared:  # SGLang reads its adaptive config from a file: a private one, removed at close
        folder = Path(tempfile.mkdtemp(prefix="moespec-sglang-adaptive-"))
        cleanup.append(folder)
        adaptive_path = folder / "adaptive.json"
        adaptive_path.write_text(json.dumps(adaptive_config(prepared)))
        spec = dataclasses.replace(spec, adaptive_config_path=str(adaptive_path))
    max_context = args.sglang_context_length or target.max_context
    config = BackendConfig(
        target=target,
        info=build_info(target, draft_name, spec, max_context, device=args.device),
        spec=spec,
        base_kwargs=base,
        stats=not args.sglang_no_expert_record,
        recorder_dir=record_dir,
        tokenizer_path=args.model_path / "tokenizer.json",
        capture_topk=args.sglang_capture_topk,
        calibrate=not args.sglang_no_calibrate,
        cleanup=tuple(cleanup),
        ep=ep,
        record_steps=record_steps,
    )
    return SGLangBackend(config, sglang, policy)


def prepared_lengths(value: str, model_algorithm: str | None) -> tuple[int, ...]:
    """--sglang-prepared-lengths: auto (every length, where the algorithm can), none, or a list."""
    adaptive = model_algorithm in ADAPTIVE_ALGORITHMS
    if value == "none":
        return ()
    if value == "auto":
        return tuple(range(MAX_DRAFT_LENGTH + 1)) if adaptive else ()
    if not adaptive:
        raise UsageError(f"--sglang-prepared-lengths: SGLang switches draft lengths at run time for "
                         f"{' and '.join(ADAPTIVE_ALGORITHMS)} only (this server drafts with "
                         f"{model_algorithm or 'NGRAM'})")
    try:
        lengths = tuple(sorted({int(part) for part in value.split(",")}))
    except ValueError:
        raise UsageError(f"--sglang-prepared-lengths wants auto, none or comma-separated lengths, got {value!r}") \
            from None
    if not lengths or not all(0 <= k <= MAX_DRAFT_LENGTH for k in lengths):
        raise UsageError(f"--sglang-prepared-lengths: lengths must be in 0-{MAX_DRAFT_LENGTH}, got {value!r}")
    if max(lengths) == 0:
        raise UsageError("--sglang-prepared-lengths: 0 alone prepares no draft length (add one >= 1, or say none)")
    return lengths


def ep_from_args(args: argparse.Namespace, target) -> EPConfig | None:
    """serve's --ep-size / --ep-placement (read by service.routing.expert_parallel_args.ep_spec) against this
    model."""
    from service.routing.expert_parallel_args import ep_spec

    if not getattr(args, "ep_size", 0) and getattr(args, "ep_placement", None) is None:
        return None  # off (or a parser without serve's flags)
    spec = ep_spec(args)
    if spec is None:
        return None
    if args.sglang_no_expert_record:
        raise UsageError("--ep-size needs the routing statistics (drop --sglang-no-expert-record)")
    try:
        return ep_config(spec, target)
    except expert_parallel.PlacementError as e:
        raise UsageError(f"--ep-placement: {e}" if args.ep_placement else f"--ep-size: {e}") from None


def record_steps_path(args: argparse.Namespace) -> Path | None:
    """--record-steps FILE, checked writable now rather than after minutes of engine start-up."""
    path = getattr(args, "record_steps", None)
    if path is None:
        return None
    if args.sglang_no_expert_record:
        raise UsageError("--record-steps needs the routing statistics (drop --sglang-no-expert-record)")
    try:
        with Path(path).open("a"):  # creates it if missing; appends nothing
            pass
    except OSError as e:
        raise UsageError(f"--record-steps: cannot write {path}: {e.strerror}") from None
    return Path(path)


def base_kwargs(args: argparse.Namespace) -> dict:
    """sglang.Engine arguments every policy shares."""
    chunked = args.sglang_chunked_prefill or devices.chunked_prefill(args.device)
    if args.sglang_tp < 1 or chunked < 1:
        raise UsageError("--sglang-tp and --sglang-chunked-prefill must be >= 1")
    out: dict = {
        **devices.engine_kwargs(args.device),
        "model_path": str(args.model_path),
        "tp_size": args.sglang_tp,
        "chunked_prefill_size": chunked,
        # A fused shared expert would occupy a routed-id slot and break the per-layer unions.
        "disable_shared_experts_fusion": True,
    }
    if args.sglang_mem_fraction is not None:
        out["mem_fraction_static"] = args.sglang_mem_fraction
    if args.sglang_context_length is not None:
        out["context_length"] = args.sglang_context_length
    for item in args.sglang_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--sglang-arg wants KEY=VALUE, got {item!r}")
        if key.startswith("speculative_"):
            raise UsageError(f"--sglang-arg {key}: speculative arguments follow the draft policy")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def tree_temperature_from_flag(flag: str, algorithm: str | None, draft_path: Path | None) -> float:
    """--sglang-tree-temperature: a number, or auto (the draft directory's record, else 1: SGLang's ranking)."""
    if flag == "auto":
        if algorithm not in TREE_ALGORITHMS or draft_path is None:
            return 1.0
        return recorded_tree_temperature(Path(draft_path))
    try:
        tau = float(flag)
    except ValueError:
        raise UsageError(f"--sglang-tree-temperature wants auto or a number, got {flag!r}") from None
    if not 0.01 <= tau <= 100:
        raise UsageError(f"--sglang-tree-temperature must be in [0.01, 100], got {tau:g}")
    if tau != 1.0 and algorithm not in TREE_ALGORITHMS:
        raise UsageError(f"--sglang-tree-temperature ranks draft trees, which only --speculative-algorithm "
                         f"{' or '.join(TREE_ALGORITHMS)} drafts")
    return tau


def recorded_tree_temperature(draft_dir: Path) -> float:
    """The greedy ranking temperature a draft directory records in TREE_RANKING_FILE (1.0 where it records
    none); a record that is not one is a UsageError naming the file."""
    path = draft_dir / TREE_RANKING_FILE
    if not path.is_file():
        return 1.0
    try:
        tau = float(json.loads(path.read_text())["greedy_temperature"])
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path}: not a tree ranking record ({e})") from None
    if not 0.01 <= tau <= 100:
        raise UsageError(f"{path}: greedy_temperature must be in [0.01, 100], got {tau:g}")
    return tau


def initial_policy(args: argparse.Namespace, spec: SpecConfig) -> DraftPolicy:
    """serve_cli's --drafter / --draft-length, if it defines them; else plain decoding."""
    drafter = Drafter(getattr(args, "drafter", Drafter.MODEL.value))
    length = getattr(args, "draft_length", 0)
    width = getattr(args, "tree_width", 1)
    if width > max_tree_width(spec):
        raise UsageError(f"--tree-width {width}: this sglang configuration drafts chains only (trees need "
                         f"--speculative-algorithm {' or '.join(TREE_ALGORITHMS)}; give 1 or leave it out)")
    if length and drafter not in spec.drafters():
        offered = ", ".join(d.value for d in spec.drafters())
        raise UsageError(f"--drafter {drafter.value}: this sglang configuration offers {offered}")
    policy = DraftPolicy(drafter=drafter, draft_length=length, tree_width=width, policy_id="default")
    try:
        policy.validate()
    except InvalidRequest as e:
        raise UsageError(f"initial draft policy: {e}") from None
    return policy
