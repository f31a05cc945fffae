"""What a backend offers: a policy checked against its ModelInfo before any work is done for it.

The server runs this on every policy it is given (the initial one, SetPolicy, each arm of a traffic
split) and `moespec generate` on its command-line policy, so a policy the backend cannot run (a table
where it takes none, a drafter or controller it lacks, a tree wider than it drafts) is refused the
same way everywhere, naming the field, instead of running as something else. Bounds that hold for
every backend are DraftPolicy.validate's.
"""

from __future__ import annotations

from service.types import DraftPolicy, InvalidRequest, ModelInfo


def check_offered(policy: DraftPolicy, info: ModelInfo) -> None:
    """InvalidRequest naming the first field of `policy` (or of one of its cells) `info` does not offer."""
    if policy.cells and not info.policy_tables:
        raise InvalidRequest("policy.cells", "this backend runs one policy for every step "
                             "(ModelInfo.policy_tables is false): give a policy without cells")
    for where, part in policy.parts():
        if part.draft_length and part.drafter not in info.drafters:
            raise InvalidRequest(f"{where}.drafter", f"{part.drafter.value!r} is not offered by this backend")
        if part.controller not in info.controllers:
            note = f" ({info.controllers_note})" if info.controllers_note else ""
            raise InvalidRequest(f"{where}.controller",
                                 f"{part.controller.value!r} is not offered by this backend{note}")
        if part.tree_width > info.max_tree_width:
            widest = ("drafts chains only" if info.max_tree_width == 1 else
                      f"drafts trees up to width {info.max_tree_width}")
            raise InvalidRequest(f"{where}.tree_width",
                                 f"{part.tree_width} is not offered: this backend {widest} (ModelInfo.max_tree_width)")
